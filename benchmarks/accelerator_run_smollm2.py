"""One accelerator run of the SmolLM2 drafters (vllm_moa/recipes/smollm2_accelerator.py) as a
results file: what the device reported (data, steps, target tokens, time, its own bf16
held-out agreement, training curves) beside the held-out agreement measured here in fp32 by
benchmarks/heldout_agreement_smollm2.py (the figure every SmolLM2 drafter is judged by), and the
chain K=3 acceptance each agreement curve implies.

    python -m benchmarks.accelerator_run_smollm2 --run OUT_OF_THE_RUN [OUT_OF_A_LATER_RUN ...] \\
        [--labels ...] --heldout heldout_moa.json heldout_eagle.json [--kernel-log kernels_gpu.log] \\
        [--job-log job.log ...] --out benchmarks/results/smollm2_accelerator_run_1.json

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


def drafter_rows(data: dict, name: str, count: int, path: Path) -> tuple[dict, list[dict]]:
    """The shipped drafter's held-out row and the `count` other held-out rows of one
    heldout_agreement_smollm2.py file, in its order."""
    rows = [d for d in data["drafters"] if d["split"] == "heldout"]
    shipped = [d for d in rows if Path(d["path"]).parts[-3:] == ("assets", "smollm2", name)]
    ran = [d for d in rows if d not in shipped]
    if len(shipped) != 1 or len(ran) != count:
        raise SystemExit(f"{path}: want the shipped {name} and {count} other drafter(s) (one per run that trained "
                         f"it, in --run order), got {[d['path'] for d in rows]}")
    return shipped[0], ran


def part(run: Path, label: str, heldout: dict[str, tuple[dict, dict, dict]], job_log: Path | None) -> dict:
    """One device run (its --out) with the fp32 held-out rows of its drafters: name -> (file, shipped, ran)."""
    report = json.loads((run / "report.json").read_text())
    drafters = {}
    for name, (data, shipped, ran) in heldout.items():
        before, after = shipped["heldout_agreement_by_depth"], ran["heldout_agreement_by_depth"]
        trained = report["drafters"][name]
        drafters[name] = {
            **{k: v for k, v in trained.items() if k not in ("config", "metrics")},
            "target_tokens_per_s": round(trained["target_tokens"] / trained["train_seconds"]),
            "heldout_agreement_fp32_before": before, "heldout_agreement_fp32_after": after,
            "chain3_estimate_before": chain3(before), "chain3_estimate_after": chain3(after),
            **{k: ran[k] for k in ("chain3_estimate_95", "chain3_minus_first_95") if k in ran},
            "train_first_96": {d["label"]: d["heldout_agreement_by_depth"] for d in data["drafters"]
                               if d["split"] == "train-first" and d["path"] in (shipped["path"], ran["path"])},
            "heldout_file_commit": data["provenance"]["commit"],
            "metrics": trained["metrics"],
            **({"from_job_log": schedule_from_log(job_log.read_text(), name)} if job_log else {}),
        }
    return {"label": label, "device": report["device"], "device_provenance": device_provenance(report["provenance"]),
            **{k: report[k] for k in ("prompts", "responses", "earlier", "batch_probe", "generated_for_later")
               if k in report},
            "warnings": report.get("warnings", []), "wall_time_s": report["wall_time_s"], "drafters": drafters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, nargs="+", required=True,
                        help="the run's --out (report.json); several: one device session's runs, in order")
    parser.add_argument("--labels", nargs="+", default=None, help="one per --run")
    parser.add_argument("--heldout", type=Path, nargs="+", required=True,
                        help="heldout_agreement_smollm2.py files, one per drafter name: the shipped one (before), "
                             "then one row per run that trained it, in --run order")
    parser.add_argument("--kernel-log", type=Path, default=None, help="pytest tests/unit/kernels on the device")
    parser.add_argument("--job-log", type=Path, nargs="*", default=[], help="each run's job log (time shares, schedules)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    labels = args.labels or [str(run) for run in args.run]
    reports = [json.loads((run / "report.json").read_text()) for run in args.run]
    per_run: list[dict] = [{} for _ in args.run]
    for path in args.heldout:
        data = json.loads(path.read_text())
        name = data["recipe_drafter"]
        which = [i for i, report in enumerate(reports) if name in report["drafters"]]
        shipped, ran = drafter_rows(data, name, len(which), path)
        for i, row in zip(which, ran):
            per_run[i][name] = (data, shipped, row)
    logs = args.job_log + [None] * (len(args.run) - len(args.job_log))
    parts = [part(run, label, held, log) for run, label, held, log in zip(args.run, labels, per_run, logs)]
    for number, later in enumerate(parts[1:], start=1):  # a later run in the same work folder keeps the
        for key in ("prompts", "responses", "batch_probe", "generated_for_later"):  # earlier report's stages
            if key in later and later[key] == parts[number - 1].get(key):
                later[key] = f"the run before's (part {number}), carried over in its work folder"
    result = {
        "what": "runs of vllm_moa/recipes/smollm2_accelerator.py on a lent GPU, and their drafters' held-out "
                "agreement measured on CPU in fp32 (96 held-out sequences of the committed dataset)",
        "parts": parts,
        "triton_kernel_tests_on_device": args.kernel_log.read_text().strip().splitlines()[-1] if args.kernel_log else None,
        "provenance": provenance(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(parts, args.out.with_suffix(".png"))
    print(json.dumps([{n: {k: d[k] for k in ("steps", "target_tokens", "train_seconds", "chain3_estimate_before",
                                            "chain3_estimate_after")} for n, d in p["drafters"].items()} for p in parts],
                     indent=1))


def plot(parts: list[dict], path: Path) -> None:
    """Held-out agreement by depth before / after per drafter and run; training loss against target tokens."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    shipped_drawn = set()
    for p in parts:
        for name, d in p["drafters"].items():
            tag = f"{name}, {p['label']}" if len(parts) > 1 else name
            depths = list(range(1, len(d["heldout_agreement_fp32_after"])))
            line, = axes[0].plot(depths, d["heldout_agreement_fp32_after"][1:], marker="o",
                                 label=f"{tag} ({d['target_tokens'] / 1e6:.1f}M tokens, {d['train_seconds']:.0f} s)")
            if name not in shipped_drawn:
                axes[0].plot(depths, d["heldout_agreement_fp32_before"][1:], ls="--", color="grey" if len(parts) > 1
                             else line.get_color(), label=f"{name} before (shipped)")
                shipped_drawn.add(name)
            batch_tokens = d["target_tokens"] / max(1, d["steps"])
            axes[1].plot([m["step"] * batch_tokens / 1e6 for m in d["metrics"]], [m["loss"] for m in d["metrics"]],
                         color=line.get_color(), label=tag)
    axes[0].set(xlabel="draft depth", ylabel="held-out top-1 agreement (fp32)",
                title=f"SmolLM2 drafters, {parts[0]['device']}")
    axes[0].legend(fontsize=7)
    axes[1].set(xlabel="target tokens trained (M)", ylabel="training loss (KL weight x KL + SmoothL1)", title="training")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
