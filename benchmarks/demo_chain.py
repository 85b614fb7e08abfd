"""Greedy chain speculative decoding with the shipped demo models on this machine's CPU, for
every drafter (MoA TLI 0/1, EAGLE-style, independent LM, n-gram lookup):
acceptance length and wall-clock speedup over plain decoding, per held-out prompt.

    python benchmarks/demo_chain.py [--num-draft 2 4] [--max-new-tokens 96]

Writes benchmarks/results/demo_chain_cpu.json (with provenance) and prints a summary. Plain and
speculative decoding run the same functional target in the same process, alternately per prompt.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch
from transformers import AutoTokenizer

from vllm_moa.decoding.chain import plain_greedy_generate, speculative_greedy_generate
from vllm_moa.demo import SHIPPED, demo_models
from vllm_moa.models import load_drafter
from vllm_moa.target import TargetModel

DRAFTERS = ("moa-tli0", "moa-tli1", "eagle", "independent", "ngram")

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-draft", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "demo_chain_cpu.json")
    args = parser.parse_args()
    target_dir, _, prompts = demo_models()
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = TargetModel.from_pretrained(target_dir)
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    plain_greedy_generate(target, prompt_ids[0], 16)  # warm-up
    rows = []
    for name in DRAFTERS:
        drafter = "ngram" if name == "ngram" else load_drafter(SHIPPED / name, target).eval()
        for k in args.num_draft:
            for i, ids in enumerate(prompt_ids):
                plain = plain_greedy_generate(target, ids, args.max_new_tokens)
                spec = speculative_greedy_generate(target, drafter, ids, args.max_new_tokens, num_draft=k)
                assert spec.token_ids == plain.token_ids, (name, k, i)
                rows.append({"drafter": name, "num_draft": k, "prompt": i, "acceptance_length": spec.acceptance_length,
                             "speedup": plain.seconds / spec.seconds, "drafter_share": spec.drafter_seconds / spec.seconds,
                             "plain_tok_s": plain.tokens_per_second, "spec_tok_s": spec.tokens_per_second})
    summary = {}
    for name in DRAFTERS:
        for k in args.num_draft:
            sel = [r for r in rows if r["drafter"] == name and r["num_draft"] == k]
            summary[f"{name}/K={k}"] = {
                "mean_acceptance_length": round(statistics.mean(r["acceptance_length"] for r in sel), 3),
                "median_speedup": round(statistics.median(r["speedup"] for r in sel), 3),
                "min_speedup": round(min(r["speedup"] for r in sel), 3),
                "max_speedup": round(max(r["speedup"] for r in sel), 3),
                "mean_drafter_share": round(statistics.mean(r["drafter_share"] for r in sel), 3),
            }
    result = {"summary": summary, "rows": rows,
              "config": {"max_new_tokens": args.max_new_tokens, "prompts": len(prompt_ids), "batch": 1, "greedy": True},
              "provenance": {"device": "cpu", "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
                             "python": platform.python_version(), "torch": torch.__version__}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(summary, args.num_draft, args.out.with_suffix(".png"))
    print(json.dumps(summary, indent=2))


def plot(summary: dict, num_draft: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(num_draft)
    for j, k in enumerate(num_draft):
        xs = [i + j * width for i in range(len(DRAFTERS))]
        axes[0].bar(xs, [summary[f"{d}/K={k}"]["mean_acceptance_length"] for d in DRAFTERS], width, label=f"K={k}")
        axes[1].bar(xs, [summary[f"{d}/K={k}"]["median_speedup"] for d in DRAFTERS], width, label=f"K={k}")
    for ax, title in zip(axes, ("mean acceptance length", "median speedup over plain decoding")):
        ax.set_xticks([i + width * (len(num_draft) - 1) / 2 for i in range(len(DRAFTERS))], DRAFTERS, rotation=15)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    axes[1].axhline(1.0, color="black", linewidth=0.8)
    fig.suptitle("Greedy chain decoding, shipped demo models, CPU, batch 1")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
