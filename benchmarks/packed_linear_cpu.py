"""What verifying n tokens costs on a CPU: SmolLM2-135M-Instruct's linear layers and its whole
forward over n new tokens (after a 96-token prefix), PyTorch's default fp32 linear against
oneDNN's pre-packed one with fused projections (vllm_moa/packed_linear.py).

    python -m benchmarks.packed_linear_cpu [--rows 1 2 4 8 16 24 32] [--repeats 8]

The ratio forward(n) / forward(1) is what a speculative round pays to verify n tokens instead of
decoding one: the smaller it stays, the more a draft tree gains. Writes
benchmarks/results/packed_linear_cpu.{json,png} with provenance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from benchmarks.provenance import ROOT, provenance  # noqa: E402
from vllm_moa import packed_linear  # noqa: E402
from vllm_moa.target import TargetKVCache, TargetModel  # noqa: E402
from vllm_moa.targets import fetch_smollm2  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (and packing)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24, 32])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=96)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "packed_linear_cpu.json")
    args = parser.parse_args()
    prov = provenance(torch_threads=torch.get_num_threads(), onednn=packed_linear.available())  # at start: the code that runs
    target = TargetModel.from_pretrained(fetch_smollm2())
    block = target.layers[0]
    attn, mlp = block.self_attn, block.mlp
    groups = {  # the products one decoder layer makes, as the target runs them
        "q/k/v fused": (attn.q_proj, attn.k_proj, attn.v_proj),
        "o": (attn.o_proj,),
        "gate/up fused": (mlp.gate_proj, mlp.up_proj),
        "down": (mlp.down_proj,),
        "lm head": (target.hf_model.lm_head,),
    }
    layers: dict[str, dict] = {}
    with torch.no_grad():
        for name, modules in groups.items():
            row = {"shape": [sum(m.out_features for m in modules), modules[0].in_features], "default_ms": [], "packed_ms": []}
            for n in args.rows:
                x = torch.randn(n, modules[0].in_features)
                with packed_linear.enabled(False):
                    row["default_ms"].append(round(median_ms(lambda: [m(x) for m in modules], args.repeats), 3))
                row["packed_ms"].append(round(median_ms(lambda: packed_linear.linear(x, *modules), args.repeats), 3))
            layers[name] = row
            print(name, row)

        prefix = torch.arange(100, 100 + args.prefix)[None]
        forward = {"default_ms": [], "packed_ms": []}
        for key, flag in (("default_ms", False), ("packed_ms", True)):
            with packed_linear.enabled(flag):
                cache = TargetKVCache()
                target(prefix, cache)
                for n in args.rows:
                    ids = torch.full((1, n), 42)

                    def step() -> None:
                        target(ids, cache)
                        cache.crop(args.prefix)

                    forward[key].append(round(median_ms(step, args.repeats), 1))
            print(key, forward[key])
    report = {
        "benchmark": "packed_linear_cpu", "target": "SmolLM2-135M-Instruct (fp32)", "rows": args.rows,
        "prefix_tokens": args.prefix, "repeats": args.repeats, "statistic": "median ms",
        "layers": layers,
        "target_forward": {
            **forward,
            "cost_vs_one_token_default": [round(t / forward["default_ms"][0], 2) for t in forward["default_ms"]],
            "cost_vs_one_token_packed": [round(t / forward["packed_ms"][0], 2) for t in forward["packed_ms"]],
        },
        "provenance": prov,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(report: dict, path: Path) -> None:
    rows = report["rows"]
    fig, (ax_fwd, ax_head) = plt.subplots(1, 2, figsize=(11, 4.2))
    fwd = report["target_forward"]
    ax_fwd.plot(rows, fwd["default_ms"], "o-", label="default fp32 linear (MKL)")
    ax_fwd.plot(rows, fwd["packed_ms"], "o-", label="oneDNN packed, fused q/k/v and gate/up")
    ax_fwd.set_xlabel("new tokens in one forward (draft tree nodes + root)")
    ax_fwd.set_ylabel("ms (median)")
    ax_fwd.set_title("SmolLM2 forward after a 96-token prefix")
    ax_fwd.set_ylim(bottom=0)
    ax_fwd.legend(fontsize=8)
    head = report["layers"]["lm head"]
    ax_head.plot(rows, head["default_ms"], "o-", label="default")
    ax_head.plot(rows, head["packed_ms"], "o-", label="packed")
    ax_head.set_xlabel("rows")
    ax_head.set_title(f"LM head {head['shape'][0]} x {head['shape'][1]}")
    ax_head.set_ylim(bottom=0)
    ax_head.legend(fontsize=8)
    prov = report["provenance"]
    fig.suptitle(f"{prov['cpu']}, {prov['torch_threads']} threads, torch {prov['versions'].get('torch')}, "
                 f"commit {prov['commit'][:8]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
