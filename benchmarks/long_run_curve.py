"""Held-out agreement of SmolLM2 drafters against the target tokens and CPU time they trained on:
every checkpoint a long run kept (vllm_moa.recipes.smollm2_long, --keep-checkpoints), plus the
drafter it started from, evaluated alike, with a fit that says what more training would give.

    python -m benchmarks.long_run_curve --runs "MoA TLI=0=~/.cache/vllm-moa/runs/smollm2-long/moa-tli0" \\
        [LABEL=DIR ...] [--max-step N] [--every 1] [--out benchmarks/results/long_run_curve_smollm2.json]

A run is LABEL=DIR (the last '=' splits them): a run directory of the long recipe; its
train_config.json says which of the recipe's drafters it trains.

Per checkpoint: the trainer's held-out agreement by depth (fp32, the 96 held-out sequences; the
evaluation of benchmarks/heldout_agreement_smollm2.py), the expected acceptance length of a chain
of K = 3 under that agreement (1 + a1 + a1 a2 + a1 a2 a3: each drafted token is accepted when it
is the target's greedy token and all before it were), the run's target tokens (exact: the data
order is a function of (seed, step)) and training CPU seconds (recorded by the trainer; absent in
checkpoints written before they were). x = the tokens of this run; the point at x = 0 is the
drafter the run started from. The fit: agreement = alpha + beta * log10(tokens) over the run's
checkpoints, so "10x more tokens" adds beta while the curve stays log-linear.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.provenance import ROOT, provenance  # noqa: E402
from vllm_moa.recipes.smollm2 import DRAFTERS, SmolRecipe  # noqa: E402
from vllm_moa.recipes.smollm2_long import SHIPPED, heldout_agreement, load_dataset, run_tokens  # noqa: E402


def chain_acceptance(agreement: list[float | None], k: int = 3) -> float:
    """Expected tokens per target forward of a greedy chain of k drafts, from agreement by depth
    1..k (index 0 of `agreement` is the anchor's own position, not a drafted token)."""
    total, alive = 1.0, 1.0
    for depth in range(1, k + 1):
        alive *= agreement[depth] or 0.0
        total += alive
    return total


def log_fit(tokens: list[int], values: list[float]) -> dict | None:
    """alpha + beta * log10(tokens) by least squares over points with tokens > 0 (None below 3)."""
    pts = [(math.log10(t), v) for t, v in zip(tokens, values) if t > 0]
    if len(pts) < 3:
        return None
    x, y = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    beta, alpha = np.polyfit(x, y, 1)
    residual = float(np.sqrt(np.mean((alpha + beta * x - y) ** 2)))
    return {"alpha": round(float(alpha), 4), "beta_per_10x_tokens": round(float(beta), 4),
            "rms_residual": round(residual, 4), "points": len(pts)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=[], help="LABEL=DIR: a label and a run directory")
    parser.add_argument("--x", choices=["tokens", "cpu"], default="tokens",
                        help="the plot's x axis: target tokens, or training CPU seconds (equal-cost ablations)")
    parser.add_argument("--replot", action="store_true", help="redraw --out's PNG from its JSON, no evaluation")
    parser.add_argument("--max-step", type=int, default=None, help="checkpoints up to this step only")
    parser.add_argument("--no-start", action="store_true",
                        help="no x = 0 point (when the shipped drafter is no longer the one the runs started from)")
    parser.add_argument("--every", type=int, default=1, help="evaluate every n-th checkpoint (the newest always)")
    parser.add_argument("--sequences", type=int, default=0, help="the runs' --sequences (0: all)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "long_run_curve_smollm2.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.replot:
        record = json.loads(args.out.read_text())
        plot(record, args.out.with_suffix(".png"), args.x)
        return record
    if not args.runs:
        parser.error("--runs is required (or --replot)")

    from vllm_moa.target import TargetModel
    from vllm_moa.targets import fetch_smollm2

    recipe = SmolRecipe()
    record = {"provenance": provenance(benchmark="long_run_curve", torch_threads=torch.get_num_threads(),
                                       config={k: str(v) for k, v in vars(args).items()}), "runs": {}}
    target = TargetModel.from_pretrained(fetch_smollm2())
    train, held = load_dataset()
    if args.sequences:
        train = train[: args.sequences]
    for spec in args.runs:
        label, _, directory = spec.rpartition("=")
        run = Path(directory).expanduser()
        trained = json.loads((run / "train_config.json").read_text())
        name = next(n for n, (kind, tli, _) in DRAFTERS.items() if (kind, tli) == (trained["drafter"], trained["tli"]))
        checkpoints = sorted(c for c in run.glob("checkpoints/step-*")
                             if args.max_step is None or int(c.name[5:]) <= args.max_step)
        if not checkpoints:
            parser.error(f"{directory}: no checkpoints")
        chosen = checkpoints[:-1][:: args.every] + checkpoints[-1:]
        points = [] if args.no_start else [
            {"step": 0, "tokens": 0, "train_cpu_seconds": 0.0, "drafter": "shipped (the run's start)",
             "agreement_by_depth": heldout_agreement(SHIPPED / name, name, target, held, recipe)}]
        for checkpoint in chosen:
            state = torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=True)
            step = int(state["step"])
            agreement = heldout_agreement(checkpoint / "drafter", name, target, held, recipe)
            points.append({"step": step, "tokens": run_tokens(train, state["config"], step),
                           "train_cpu_seconds": round(float(state.get("train_cpu_seconds", float("nan"))), 1),
                           "drafter": checkpoint.name, "agreement_by_depth": agreement})
            print(json.dumps(points[-1]), flush=True)
        for point in points:
            point["chain3_acceptance_estimate"] = round(chain_acceptance(point["agreement_by_depth"]), 3)
        tokens = [p["tokens"] for p in points]
        record["runs"][label] = {
            "directory": directory, "drafter": name, "options": trained["drafter_options"], "points": points,
            "fit_agreement_depth1": log_fit(tokens, [p["agreement_by_depth"][1] for p in points]),
            "fit_chain3_acceptance": log_fit(tokens, [p["chain3_acceptance_estimate"] for p in points]),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    plot(record, args.out.with_suffix(".png"), args.x)
    print(f"wrote {args.out}")
    return record


def plot(record: dict, path: Path, x: str = "tokens") -> None:
    """Agreement at depth 1 and the chain estimate against tokens (with the fits) or CPU seconds."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x_key = "tokens" if x == "tokens" else "train_cpu_seconds"
    for name, run in record["runs"].items():
        pts = [p for p in run["points"] if p["tokens"] > 0]
        for ax, key, fit in ((axes[0], lambda p: p["agreement_by_depth"][1], run["fit_agreement_depth1"]),
                             (axes[1], lambda p: p["chain3_acceptance_estimate"], run["fit_chain3_acceptance"])):
            line = ax.plot([p[x_key] for p in pts], [key(p) for p in pts], "o-", label=name)[0]
            if run["points"][0]["tokens"] == 0:
                ax.axhline(key(run["points"][0]), color=line.get_color(), ls=":", lw=1)
            if fit and x == "tokens":
                xs = np.logspace(math.log10(pts[0]["tokens"]), math.log10(pts[-1]["tokens"] * 10), 50)
                ax.plot(xs, fit["alpha"] + fit["beta_per_10x_tokens"] * np.log10(xs), "--",
                        color=line.get_color(), lw=1, label=f"{name} fit: +{fit['beta_per_10x_tokens']:.3f} per 10x")
    axes[0].set_ylabel("held-out agreement at depth 1")
    axes[1].set_ylabel("chain K=3 acceptance (estimate)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("target tokens trained on in this run (dotted: its start)" if x == "tokens"
                      else "training CPU seconds in this run (dotted: its start)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
