"""The transformers runtime at batch 1, 4 and 16 on SmolLM2-135M-Instruct (CPU, greedy): plain
decoding through the same batched engine (no drafter) against MoA, EAGLE-style and n-gram
drafters, as chains of K = 3 and one small tree.

    python -m benchmarks.runtime_batch_cpu --prompts ../shared/data/specbench/mt_bench/question.jsonl \
        [--batches 1 4 16] [--max-new-tokens 48] [--adaptive]

--adaptive runs every configuration a second time with SpeculativeEngine(..., adaptive=True): each
round's depth, plain decoding included, chosen from measured costs and acceptance
(decoding/speed_control.py); its rows also give the share of rounds it decoded plainly.

For each batch size B, B prompts (chat-templated Spec-Bench questions, cycled if there are fewer)
run as one ragged batch: plain, then each configuration, alternately; every sequence's output is
checked equal to plain greedy decoding. Throughput = generated tokens / wall time of the batch;
speedup = paired time ratio against the plain run just before. Drafting still runs sequence by
sequence inside a round (one drafter call per sequence and level), which is what this measures.
Writes benchmarks/results/runtime_batch_cpu_smollm2.{json,png} with provenance.
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
from vllm_moa.decoding.engine import SpeculativeEngine, summarize  # noqa: E402
from vllm_moa.decoding.tree import DraftSpec  # noqa: E402
from vllm_moa.models import load_drafter  # noqa: E402
from vllm_moa.shipped import SHIPPED_SMOLLM2  # noqa: E402
from vllm_moa.target import TargetModel  # noqa: E402
from vllm_moa.targets import fetch_smollm2  # noqa: E402
from vllm_moa.training.data import encode_prompt, read_prompts  # noqa: E402

SHAPES = {"chain K=3": DraftSpec.chain(3), "tree 3,2,4": DraftSpec.tree(3, 2, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, required=True, help="a Spec-Bench question.jsonl")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--drafters", nargs="+", default=["moa-tli0", "eagle", "ngram"])
    parser.add_argument("--repeats", type=int, default=2, help="plain/speculative pairs per configuration")
    parser.add_argument("--adaptive", action="store_true", help="each configuration also with adaptive=True")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "runtime_batch_cpu_smollm2.json")
    args = parser.parse_args()
    prov = provenance(torch_threads=torch.get_num_threads())  # at start: the code that runs
    target_dir = fetch_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = TargetModel.from_pretrained(target_dir)
    texts = read_prompts(args.prompts)[: max(args.batches)]  # batch b takes the first b, cycled
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    drafters = {name: "ngram" if name == "ngram" else load_drafter(SHIPPED_SMOLLM2 / name, target).eval()
                for name in args.drafters}
    plain_engine = SpeculativeEngine(target, None)
    plain_engine.generate([prompts[0]], 8)  # warm-up
    rows = []
    for batch in args.batches:
        ids = [prompts[i % len(prompts)] for i in range(batch)]
        for name, drafter in tqdm(drafters.items(), desc=f"batch {batch}"):
            for (shape_name, spec), adaptive in ((shape, a) for shape in SHAPES.items()
                                                 for a in ((False, True) if args.adaptive else (False,))):
                engine = SpeculativeEngine(target, drafter, spec, adaptive=adaptive)
                shape_name = f"{shape_name}, adaptive" if adaptive else shape_name
                engine.generate([ids[0]], 4)  # warm-up
                plain_s = spec_s = 0.0
                results = []
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    plain = plain_engine.generate(ids, args.max_new_tokens)
                    plain_s += time.perf_counter() - started
                    started = time.perf_counter()
                    out = engine.generate(ids, args.max_new_tokens)
                    spec_s += time.perf_counter() - started
                    for p, o in zip(plain, out):
                        assert o.token_ids == p.token_ids, f"{name} {shape_name} batch {batch}: output differs from plain"
                    results += out
                tokens = sum(len(r.token_ids) for r in results)
                summary = summarize(results, spec_s, spec.depth)
                rows.append({
                    "batch": batch, "drafter": name, "draft": shape_name,
                    "acceptance_length": round(summary["acceptance_length"], 3),
                    "tokens_per_s": round(tokens / spec_s, 1), "plain_tokens_per_s": round(tokens / plain_s, 1),
                    "speedup": round(plain_s / spec_s, 3), "drafter_share": round(summary["drafter_share"], 3),
                    "plain_round_share": round(sum(d == 0 for r in results for d in r.drafted_per_forward)
                                               / max(1, sum(len(r.drafted_per_forward) for r in results)), 3),
                })
                print(rows[-1])
    report = {
        "benchmark": "runtime_batch_cpu", "target": "SmolLM2-135M-Instruct (fp32)", "prompts": str(args.prompts.parent.name),
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "decoding": "greedy, outputs checked equal to plain",
        "drafting": "sequence by sequence within each round", "rows": rows, "provenance": prov,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(report: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    keys = sorted({(r["drafter"], r["draft"]) for r in report["rows"]})
    for drafter, draft in keys:
        sel = [r for r in report["rows"] if r["drafter"] == drafter and r["draft"] == draft]
        ax.plot([r["batch"] for r in sel], [r["speedup"] for r in sel], "o-", label=f"{drafter}, {draft}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences decoded together)")
    ax.set_ylabel("speedup over plain batched decoding")
    ax.legend(fontsize=7)
    prov = report["provenance"]
    ax.set_title(f"SmolLM2, {report['prompts']}, greedy - {prov['cpu']}, {prov['torch_threads']} threads, "
                 f"commit {prov['commit'][:8]}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
