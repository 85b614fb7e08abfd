"""One accelerator run of the SmolLM2 drafters (vllm_moa/recipes/smollm2_accelerator.py) as a
results file: what the device reported (data, steps, target tokens, time, its own bf16
held-out agreement, training curves) beside the held-out agreement measured here in fp32 by
benchmarks/heldout_agreement_smollm2.py (the figure every SmolLM2 drafter is judged by), and the
chain K=3 acceptance each agreement curve implies.

    python -m benchmarks.accelerator_run_smollm2 --run OUT_OF_THE_RUN \\
        --heldout heldout_moa.json heldout_eagle.json [--kernel-log kernels_gpu.log] \\
        --out benchmarks/results/smollm2_accelerator_run_1.json

Writes the JSON and a PNG (held-out agreement by depth before / after per drafter; the training
loss against target tokens).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.heldout_agreement_smollm2 import chain_estimate  # noqa: E402
from benchmarks.provenance import provenance  # noqa: E402


def chain3(agreement: list[float]) -> float:
    """The chain K=3 estimate of an agreement curve (heldout_agreement_smollm2.chain_estimate)."""
    return round(float(chain_estimate(np.array(agreement), np.ones(len(agreement)))), 3)


def schedule_from_log(log: str, name: str) -> dict:
    """What the job's log says of drafter `name`: its time share and the last schedule length it
    printed ("<name> step S/N": N is the schedule the learning rate decays over)."""
    share = re.findall(rf"training {re.escape(name)} for (\d+) s", log)
    steps = re.findall(rf"{re.escape(name)} step (\d+)/(\d+)", log)
    return {"share_s": int(share[-1]) if share else None, "schedule_steps": int(steps[-1][1]) if steps else None}


def device_provenance(reported: dict) -> dict:
    """What ran on the device: the commit its code was (`--code-commit`: the device gets a copy of
    the tree, whose own git reading describes the copy, not the code), Python, torch, cores."""
    commit = reported.get("code") or reported["commit"]
    return {"commit": subprocess.run(["git", "rev-parse", commit], capture_output=True, text=True).stdout.strip()
            or commit, "code": "that commit's tree (assets and results left behind for the transfer)",
            **{k: reported[k] for k in ("python", "torch", "cpu_count", "torch_threads", "machine") if k in reported}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="the run's --out (report.json)")
    parser.add_argument("--heldout", type=Path, nargs="+", required=True,
                        help="heldout_agreement_smollm2.py files: first drafter 'shipped' (before), then the run's")
    parser.add_argument("--kernel-log", type=Path, default=None, help="pytest tests/unit/kernels on the device")
    parser.add_argument("--job-log", type=Path, default=None, help="the job's log (time shares, schedules)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    report = json.loads((args.run / "report.json").read_text())
    drafters = {}
    for path in args.heldout:
        data = json.loads(path.read_text())
        name = data["recipe_drafter"]
        rows = [d for d in data["drafters"] if d["split"] == "heldout"]
        shipped = [d for d in rows if Path(d["path"]).parts[-3:] == ("assets", "smollm2", name)]
        ran = [d for d in rows if d not in shipped]
        if len(shipped) != 1 or len(ran) != 1:
            raise SystemExit(f"{path}: want the shipped {name} and one other drafter, got {[d['path'] for d in rows]}")
        before, after = shipped[0]["heldout_agreement_by_depth"], ran[0]["heldout_agreement_by_depth"]
        run = report["drafters"][name]
        drafters[name] = {
            **{k: v for k, v in run.items() if k not in ("config", "metrics")},
            "target_tokens_per_s": round(run["target_tokens"] / run["train_seconds"]),
            "heldout_agreement_fp32_before": before, "heldout_agreement_fp32_after": after,
            "chain3_estimate_before": chain3(before), "chain3_estimate_after": chain3(after),
            "train_first_96": {d["label"]: d["heldout_agreement_by_depth"] for d in data["drafters"]
                               if d["split"] == "train-first"},
            "heldout_file_commit": data["provenance"]["commit"],
            "metrics": run["metrics"],
            **({"from_job_log": schedule_from_log(args.job_log.read_text(), name)} if args.job_log else {}),
        }
    kernel_summary = None
    if args.kernel_log:
        kernel_summary = args.kernel_log.read_text().strip().splitlines()[-1]
    result = {
        "what": "one run of vllm_moa/recipes/smollm2_accelerator.py on a lent GPU, and its drafters' held-out "
                "agreement measured on CPU in fp32 (96 held-out sequences of the committed dataset)",
        "device": report["device"], "device_provenance": device_provenance(report["provenance"]),
        "prompts": report["prompts"], "responses": report["responses"], "warnings": report.get("warnings", []),
        "wall_time_s": report["wall_time_s"], "drafters": drafters,
        "triton_kernel_tests_on_device": kernel_summary,
        "provenance": provenance(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, d in drafters.items():
        depths = list(range(1, len(d["heldout_agreement_fp32_after"])))
        line, = axes[0].plot(depths, d["heldout_agreement_fp32_after"][1:], marker="o",
                             label=f"{name} after ({d['target_tokens'] / 1e6:.1f}M tokens, {d['train_seconds']:.0f} s)")
        axes[0].plot(depths, d["heldout_agreement_fp32_before"][1:], ls="--", color=line.get_color(),
                     label=f"{name} before (shipped)")
        batch_tokens = d["target_tokens"] / max(1, d["steps"])
        axes[1].plot([m["step"] * batch_tokens / 1e6 for m in d["metrics"]], [m["loss"] for m in d["metrics"]],
                     color=line.get_color(), label=name)
    axes[0].set(xlabel="draft depth", ylabel="held-out top-1 agreement (fp32)", title=f"SmolLM2 drafters, {report['device']}")
    axes[0].legend(fontsize=7)
    axes[1].set(xlabel="target tokens trained (M)", ylabel="training loss (KL weight x KL + SmoothL1)", title="training")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(json.dumps({n: {k: d[k] for k in ("steps", "target_tokens", "train_seconds", "chain3_estimate_before",
                                             "chain3_estimate_after")} for n, d in drafters.items()}, indent=1))


if __name__ == "__main__":
    main()
