"""Acceptance of the SmolLM2 drafters on held-out Spec-Bench sets, through the transformers runtime.

    python -m benchmarks.acceptance_smollm2 --specbench ../shared/data/specbench \
        [--sets mt_bench gsm8k alpaca qa sum] [--num-prompts 8] [--max-new-tokens 64]

For each set: the first turn of its first N questions, chat-templated, answered by SmolLM2-135M-
Instruct (vllm-moa fetch smollm2) with greedy decoding; plain decoding gives the reference and
every drafter x draft shape (chains of K, an EAGLE-2 tree) must reproduce it token for token.
Sequences of a set run as one ragged batch (acceptance does not depend on batching; time is not
measured here: see benchmarks/runtime_cpu.py for speed). Reports acceptance length (tokens per
target forward) and per-position acceptance, JSON + PNG in benchmarks/results/.

The Spec-Bench files are read from the path given; they are never copied into the package.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from benchmarks.provenance import ROOT, provenance  # noqa: E402
from vllm_moa.chat import encode_prompt  # noqa: E402
from vllm_moa.decoding.engine import SpeculativeEngine
from vllm_moa.decoding.results import summarize  # noqa: E402
from vllm_moa.decoding.tree import DraftSpec  # noqa: E402
from vllm_moa.models import load_drafter  # noqa: E402
from vllm_moa.shipped import SHIPPED_SMOLLM2  # noqa: E402
from vllm_moa.target import TargetModel  # noqa: E402
from vllm_moa.targets import fetch_smollm2  # noqa: E402
from vllm_moa.training.data import read_prompts  # noqa: E402

SETS = ("mt_bench", "gsm8k", "alpaca", "qa", "sum")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specbench", type=Path, required=True, help="folder with <set>/question.jsonl")
    parser.add_argument("--sets", nargs="+", default=list(SETS))
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="refuse nothing: keep the last N tokens")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--drafters", nargs="+", default=None, help="shipped names or directories (default: all shipped)")
    parser.add_argument("--chains", type=int, nargs="+", default=[4])
    parser.add_argument("--tree", type=int, nargs=3, default=[5, 4, 16], metavar=("DEPTH", "TOP_K", "BUDGET"))
    parser.add_argument("--no-ngram", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "acceptance_smollm2.json")
    args = parser.parse_args()

    origin = provenance(torch_threads=torch.get_num_threads())  # at the start: the code that runs
    folder = fetch_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    target = TargetModel.from_pretrained(folder)
    names = args.drafters or sorted(d.name for d in SHIPPED_SMOLLM2.iterdir() if (d / "config.json").is_file())
    drafters = {Path(n).name: load_drafter(Path(n) if Path(n).is_dir() else SHIPPED_SMOLLM2 / n, target).eval()
                for n in names}
    if not args.no_ngram:
        drafters["ngram"] = "ngram"
    shapes = {f"chain K={k}": DraftSpec.chain(k) for k in args.chains}
    tree = DraftSpec.tree(*args.tree)
    shapes[f"tree d={tree.depth} k={tree.top_k} b={tree.budget}"] = tree
    rows, started = [], time.time()
    for name in args.sets:
        texts = read_prompts(args.specbench / name / "question.jsonl")[: args.num_prompts]
        prompts = [encode_prompt(tokenizer, t)[-args.prompt_tokens:] for t in texts]
        reference = [r.token_ids for r in SpeculativeEngine(target, None).generate(prompts, args.max_new_tokens)]
        for drafter_name, drafter in tqdm(drafters.items(), desc=name):
            for shape_name, spec in shapes.items():
                results = SpeculativeEngine(target, drafter, spec).generate(prompts, args.max_new_tokens)
                if [r.token_ids for r in results] != reference:
                    raise AssertionError(f"{name}/{drafter_name}/{shape_name}: output differs from greedy decoding")
                summary = summarize(results, 1.0, spec.depth)
                rows.append({"set": name, "drafter": drafter_name, "draft": shape_name,
                             "acceptance_length": round(summary["acceptance_length"], 3),
                             "acceptance_by_position": [round(x, 3) for x in summary["acceptance_by_position"]],
                             "target_forwards": summary["target_forwards"], "tokens": summary["tokens"]})
                print(f"{name:9s} {drafter_name:12s} {shape_name:18s} AL {rows[-1]['acceptance_length']:.2f}", flush=True)
    tree_name = list(shapes)[-1]
    by = {(r["set"], r["drafter"], r["draft"]): r["acceptance_length"] for r in rows}
    mean = {f"{d} / {s}": round(sum(by[(n, d, s)] for n in args.sets) / len(args.sets), 3)
            for d in drafters for s in shapes}
    report = {
        "benchmark": "acceptance_smollm2", "target": "SmolLM2-135M-Instruct (vllm-moa fetch smollm2, fp32)",
        "sets": args.sets, "prompts_per_set": args.num_prompts, "max_new_tokens": args.max_new_tokens,
        "decoding": "greedy; every output checked equal to plain greedy decoding; one ragged batch per set",
        "drafters": {n: str(Path(n) if Path(n).is_dir() else SHIPPED_SMOLLM2.relative_to(ROOT) / n) for n in names},
        "mean_over_sets": mean,
        "moa_over_eagle_tree": {f"{d}/eagle": round(sum(by[(n, d, tree_name)] / by[(n, 'eagle', tree_name)]
                                                        for n in args.sets) / len(args.sets), 3)
                                for d in drafters if d.startswith("moa") and "eagle" in drafters},
        "rows": rows, "wall_time_s": round(time.time() - started, 1),
        "provenance": origin,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, list(drafters), list(shapes), args.out.with_suffix(".png"))
    print(json.dumps({k: report[k] for k in ("mean_over_sets", "moa_over_eagle_tree")}, indent=2))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(report: dict, drafters: list[str], shapes: list[str], path: Path) -> None:
    sets = report["sets"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.2), squeeze=False)
    by = {(r["set"], r["drafter"], r["draft"]): r["acceptance_length"] for r in report["rows"]}
    width = 0.8 / len(drafters)
    for ax, shape in zip(axes[0], shapes):
        for j, drafter in enumerate(drafters):
            xs = [i + j * width for i in range(len(sets))]
            ax.bar(xs, [by[(s, drafter, shape)] for s in sets], width, label=drafter, color=f"C{j}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sets))], sets)
        ax.set_title(f"{shape}: acceptance length")
        ax.axhline(1.0, color="black", linewidth=0.6)
    axes[0][0].legend(fontsize=8)
    prov = report["provenance"]
    fig.suptitle(f"SmolLM2-135M-Instruct, Spec-Bench, {report['prompts_per_set']} prompts x "
                 f"{report['max_new_tokens']} tokens per set, greedy - commit {prov['commit'][:8]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
