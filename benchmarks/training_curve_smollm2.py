"""Held-out acceptance of the shipped SmolLM2 drafters against the target tokens they have trained
on, over every run their cards record (CPU long runs, then accelerator runs), with a log-linear fit
that says what more training would give.

    python -m benchmarks.training_curve_smollm2 [--goal 2.3] \\
        [--out benchmarks/results/training_curve_smollm2.json]

Read from vllm_moa/assets/smollm2/card.json alone (no model runs): each `long_runs` entry holds its
target tokens and the held-out agreement by depth of the drafter it started from (fp32, the 96
held-out sequences of the committed dataset, benchmarks/heldout_agreement_smollm2.py's
evaluation); the card's own figure is the drafter shipped now. y = the chain K=3 acceptance
those agreements imply (1 + a1 + a1 a2 + a1 a2 a3). x = target tokens trained on so far; the first
point's x (the first shipped drafter, before any long run) is approximate: its steps x batch x the
mean sequence length of the feature cache it trained from (docs/results.md, "Its drafters").

The data grew between runs (2,969 sequences on CPU, then + 8,192, then + 6,498 on GPUs), so the
curve is over tokens and data together; the fit y = a + b log10(x) is per drafter over all its
points, `tokens_for_goal` is where that line reaches --goal and `tokens_for_goal_from_last_point`
where a line of the same slope through the last point does (extrapolations, nothing more).
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

from benchmarks.accelerator_run_smollm2 import chain3  # noqa: E402
from benchmarks.provenance import ROOT, provenance  # noqa: E402

CARD = ROOT / "vllm_moa" / "assets" / "smollm2" / "card.json"
FIRST_BATCH = 8  # the first drafters: 360 steps x 8 sequences from the feature cache
FEATURE_CACHE_MEAN_TOKENS = 179_024 / 1_200  # tokens / sequences of that cache


def run_label(run: dict) -> str:
    return run.get("accelerator") or f"CPU ({run.get('cores')} cores)"


def drafter_points(entry: dict) -> list[dict]:
    """(tokens so far, chain K=3 estimate, what trained last) for one drafter of the card."""
    tokens = entry["steps"] * FIRST_BATCH * FEATURE_CACHE_MEAN_TOKENS
    points, after = [], "first drafter (x approximate)"
    for run in entry.get("long_runs", []):
        points.append({"tokens": round(tokens), "chain3_estimate": chain3(run["heldout_agreement_before"]),
                       "after": after})
        tokens += run["target_tokens"]
        after = f"{run_label(run)}: {run['target_tokens'] / 1e6:.1f}M tokens"
    points.append({"tokens": round(tokens), "chain3_estimate": chain3(entry["heldout_agreement_by_depth"]),
                   "after": after})
    return points


def fit(points: list[dict], goal: float) -> dict:
    x = np.log10([p["tokens"] for p in points])
    y = np.array([p["chain3_estimate"] for p in points])
    slope, intercept = np.polyfit(x, y, 1)
    residual = y[-1] - (intercept + slope * x[-1])  # the drafter shipped now, against the line
    reach = 10 ** ((goal - intercept) / slope) if slope > 0 else math.inf
    # the same slope through the last point: the line's offset there does not move the estimate
    from_last = 10 ** (x[-1] + (goal - y[-1]) / slope) if slope > 0 else math.inf
    return {"intercept": round(float(intercept), 4), "per_10x_tokens": round(float(slope), 4),
            "last_point_residual": round(float(residual), 4), "goal": goal,
            "tokens_for_goal": None if math.isinf(reach) else float(f"{reach:.3g}"),
            "tokens_for_goal_from_last_point": None if math.isinf(from_last) else float(f"{from_last:.3g}")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--goal", type=float, default=2.3, help="chain K=3 acceptance to extrapolate to")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "training_curve_smollm2.json")
    args = parser.parse_args()
    card = json.loads(CARD.read_text())
    drafters = {}
    for name in ("moa-tli0", "eagle"):
        points = drafter_points(card["drafters"][name])
        drafters[name] = {"points": points, "fit": fit(points, args.goal)}
    result = {"what": "held-out chain K=3 estimate of the shipped SmolLM2 drafters against the target tokens "
                      "trained on, from their cards", "card": str(CARD.relative_to(ROOT)), "drafters": drafters,
              "provenance": provenance()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(drafters, args.goal, args.out.with_suffix(".png"))
    print(json.dumps({n: d["fit"] for n, d in drafters.items()}, indent=1))


def plot(drafters: dict, goal: float, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for (name, data), color in zip(drafters.items(), ("tab:blue", "tab:orange")):
        x = [p["tokens"] for p in data["points"]]
        y = [p["chain3_estimate"] for p in data["points"]]
        ax.plot(x, y, "o-", color=color, label=name)
        f = data["fit"]  # the fit drawn to 10x the last point, or past the goal where that is further
        line = np.logspace(math.log10(min(x)), math.log10(min(1e11, max(max(x) * 10, 1.5 * f["tokens_for_goal"]))), 50)
        ax.plot(line, f["intercept"] + f["per_10x_tokens"] * np.log10(line), "--", color=color, alpha=0.6,
                label=f"{name} fit: +{f['per_10x_tokens']:.2f} per 10x tokens")
    ax.axhline(goal, color="gray", lw=0.8, ls=":", label=f"goal {goal}")
    ax.set_xscale("log")
    ax.set_xlabel("target tokens trained on (data grew between runs)")
    ax.set_ylabel("held-out chain K=3 acceptance estimate (fp32)")
    ax.set_title("SmolLM2 drafters: acceptance against training tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
