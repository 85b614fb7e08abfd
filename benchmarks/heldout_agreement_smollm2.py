"""Held-out top-1 agreement by draft depth of SmolLM2 drafters: the figure a training change is
judged by before it is judged by speed (acceptance through the runtime: acceptance_smollm2.py).

    python -m benchmarks.heldout_agreement_smollm2 [--drafters shipped DIR ...] [--labels ...] \\
        [--recipe moa-tli0] [--out benchmarks/results/heldout_agreement_smollm2.json]

Every drafter is evaluated on the same 96 held-out sequences of the committed regenerated dataset
(vllm_moa/recipes/data: the target's own greedy answers to prompts never trained on), with the
trainer's own evaluation (K-step anchors drawn from a fixed evaluation stream, so every drafter
sees the same anchors), in fp32, so that drafters trained in bf16 or shipped in fp16 compare on
equal terms. "shipped" is the recipe's drafter in vllm_moa/assets/smollm2; a directory is a
drafter directory (config.json + model.safetensors), e.g. a checkpoint's drafter/ of the long run.

--splits heldout train-first train-last evaluates the same way on 96 training sequences too (the
first 96 of the dataset, in every long run's subset; the last 96, only in runs on all of it): the
gap between them and the held-out ones is what the drafter memorised.

--bootstrap N (default 2000) resamples the sequences: each row gets its chain K=3 estimate with a
95% interval, and every row after the first of its split the interval of its difference from that
first row, over the same resamples (paired), which is what "within noise" means in these files.

Writes the JSON (with provenance and each drafter's card or training state where there is one)
and a PNG of agreement against depth.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from benchmarks.provenance import ROOT, provenance  # noqa: E402
from vllm_moa.recipes.smollm2 import DRAFTERS, SmolRecipe  # noqa: E402
from vllm_moa.recipes.smollm2_long import SHIPPED, heldout_agreement_by_sequence, load_dataset  # noqa: E402
from vllm_moa.training.losses import agreement_of_sequences  # noqa: E402

SPLITS = {  # (train, held-out) -> 96 sequences
    "heldout": lambda train, held: held,
    "train-first": lambda train, held: train[:96],
    "train-last": lambda train, held: train[-96:],
}


def describe(drafter_dir: Path) -> dict:
    """What is known of how a drafter was made: its checkpoint step, or the shipped card's numbers."""
    info: dict = {"path": str(drafter_dir)}
    state = drafter_dir.parent / "trainer_state.pt"
    if state.is_file():
        info["checkpoint_step"] = int(torch.load(state, map_location="cpu", weights_only=True)["step"])
    return info


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", nargs="+", default=["shipped"], help="'shipped' or drafter directories")
    parser.add_argument("--labels", nargs="+", default=None, help="one label per drafter (default: the paths)")
    parser.add_argument("--recipe", choices=sorted(DRAFTERS), default="moa-tli0", help="the recipe's drafter shape")
    parser.add_argument("--splits", nargs="+", choices=sorted(SPLITS), default=["heldout"],
                        help="sequences to evaluate on (96 each): held-out, or training sequences (memorisation)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--bootstrap", type=int, default=2000,
                        help="resamples of the sequences for 95%% intervals of each drafter's chain K=3 estimate and "
                             "of its difference from the first drafter's (paired: the same resampled sequences)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "heldout_agreement_smollm2.json")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.drafters):
        parser.error("--labels needs one label per drafter")
    if args.threads:
        torch.set_num_threads(args.threads)

    from vllm_moa.target import TargetModel
    from vllm_moa.targets import fetch_smollm2

    record = provenance(torch_threads=torch.get_num_threads(), config=vars(args) | {"out": str(args.out)})
    recipe = SmolRecipe()
    target = TargetModel.from_pretrained(fetch_smollm2())
    train, held = load_dataset()
    rows = []
    for index, name in enumerate(args.drafters):
        directory = SHIPPED / args.recipe if name == "shipped" else Path(name)
        for split in args.splits:
            label = args.labels[index] if args.labels else name
            label = label if args.splits == ["heldout"] else f"{label} ({split})"
            per_sequence = heldout_agreement_by_sequence(directory, args.recipe, target, SPLITS[split](train, held),
                                                         recipe)
            rows.append({"label": label, "split": split, **describe(directory),
                         "heldout_agreement_by_depth": agreement_of_sequences(per_sequence), "per_sequence": per_sequence})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_sequence"}))
    intervals = bootstrap(rows, args.bootstrap) if args.bootstrap else {}
    for row in rows:
        row.pop("per_sequence")
        row.update(intervals.get((row["label"], row["split"]), {}))
    result = {"what": "held-out top-1 agreement with SmolLM2-135M-Instruct by draft depth (index k >= 1: the k-th "
                      "drafted token; index 0: the anchor itself, which the target supplies at inference), the "
                      "trainer's evaluation in fp32 on the committed dataset's 96 held-out sequences",
              "heldout_sequences": len(held), "recipe_drafter": args.recipe, "drafters": rows,
              "provenance": record}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    figure, axis = plt.subplots(figsize=(6.5, 4))
    for row in rows:  # index 0 is the anchor itself (the target's own token at inference): not drafted
        depths = [d for d, v in enumerate(row["heldout_agreement_by_depth"]) if v is not None and d >= 1]
        axis.plot(depths, [row["heldout_agreement_by_depth"][d] for d in depths], marker="o", label=row["label"])
    axis.set_xlabel("draft depth (k-th drafted token)")
    axis.set_ylabel("top-1 agreement with the target")
    axis.set_title("SmolLM2 drafters, held-out agreement")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(args.out.with_suffix(".png"), dpi=120)
    return result


def chain_estimate(hits: np.ndarray, counts: np.ndarray, k: int = 3) -> np.ndarray:
    """1 + a1 + a1 a2 + ... + a1..ak from summed hits / counts [..., depth]: the expected tokens per
    target forward of a chain of k drafts if depth d is accepted with its agreement."""
    rates = hits[..., 1 : k + 1] / np.maximum(counts[..., 1 : k + 1], 1)
    return 1 + np.cumprod(rates, axis=-1).sum(-1)


def bootstrap(rows: list[dict], resamples: int, seed: int = 0) -> dict:
    """95% intervals of each row's chain K=3 estimate and of its difference from the first row of
    its split, resampling sequences with replacement (the same resamples for every row: paired)."""
    rng = np.random.default_rng(seed)
    out = {}
    for split in dict.fromkeys(row["split"] for row in rows):
        group = [row for row in rows if row["split"] == split]
        hits = np.array([[h for h, _ in row["per_sequence"]] for row in group])  # [drafters, sequences, depth]
        counts = np.array([[c for _, c in row["per_sequence"]] for row in group])
        picks = rng.integers(0, hits.shape[1], size=(resamples, hits.shape[1]))
        estimates = chain_estimate(hits[:, picks].sum(2), counts[:, picks].sum(2))  # [drafters, resamples]
        for index, row in enumerate(group):
            entry = {"chain3_estimate": round(float(chain_estimate(hits[index].sum(0), counts[index].sum(0))), 4),
                     "chain3_estimate_95": [round(float(q), 4) for q in np.percentile(estimates[index], [2.5, 97.5])]}
            if index:
                difference = estimates[index] - estimates[0]
                entry["chain3_minus_first_95"] = [round(float(q), 4) for q in np.percentile(difference, [2.5, 97.5])]
            out[(row["label"], row["split"])] = entry
    return out


if __name__ == "__main__":
    main()
