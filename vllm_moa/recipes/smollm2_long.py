"""A long, resumable training run of a SmolLM2 drafter, meant to run in the background across
sessions and machines:

    nice -n 19 python -m vllm_moa.recipes.smollm2_long --drafter moa-tli0 [--hours 2 | --cpu-hours 1] \\
        [--work ~/.cache/vllm-moa/runs/smollm2-long] [--sequences 0] [--steps 20000] [--threads 1]

* data: the recipe's regenerated token ids, committed in this package (DATASET: the target's own
  answers to 2,969 training prompts + 96 held-out ones), so a fresh machine needs no regeneration;
* features: the offline feature cache is built once per machine in --work (resumable, ~25 KB per
  token), then every step reads it;
* state: the newest checkpoint in --work/<drafter>/checkpoints (weights, optimizer, scheduler,
  step; data order, anchors and staircase are functions of (seed, step)) is resumed; without one
  the drafter starts from the shipped one (vllm_moa/assets/smollm2) unless --from-scratch (only a
  run from scratch goes through the SA staircase curriculum, over 5% of --steps);
* equal-cost ablations: --threads 1 and --cpu-hours H stop a run at H hours of recorded training
  CPU time (resumed runs included; a paused process accrues none); --lsa-layer-stride N trains
  an MoA drafter whose LSA reads every N-th layer with the last, in its own run directory;
* long answers: --long-data adds the target's long continuations (smollm2_long_data.py, >= 1,024
  tokens each) to the training sequences and trains on 1,280 tokens of each (--max-length), in a
  run directory of its own;
* checkpoints every --checkpoint-minutes (default 10) and when --hours run out; progress in
  metrics.jsonl; held-out agreement by depth at the end in --work/<drafter>/long_report.json.

    python -m vllm_moa.recipes.smollm2_long --drafter moa-tli0 --ship [--checkpoint DIR]

ships the newest checkpoint (or DIR) instead of training: fp16 weights into vllm_moa/assets/smollm2,
the card's entry for the drafter updated with the run (steps, target tokens, recorded time) and
the held-out agreement, measured here, before and after.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time
from pathlib import Path

import torch

from vllm_moa import envs
from vllm_moa.recipes.smollm2 import (
    DEFAULT_ANCHORS,
    DEFAULT_KL_WEIGHT,
    DRAFTERS,
    SmolRecipe,
    draft_vocabulary,
    long_runs,
    model_card,
    provenance,
    write_fp16,
)
from vllm_moa.training.data import (
    DraftExample,
    examples_from_json,
    examples_to_json,
    global_batch_indices,
    sequence_repeats,
)

DATASET = Path(__file__).with_name("data") / "smollm2_responses.json.gz"
# long on-policy sequences (smollm2_long_data.py), for --long-data
LONG_DATASET = Path(__file__).with_name("data") / "smollm2_long_responses.json.gz"
LONG_MAX_LENGTH = 1280  # a prompt and 1,024 new tokens
SHIPPED = Path(__file__).resolve().parents[1] / "assets" / "smollm2"
DEFAULT_WORK = envs.VLLM_MOA_CACHE / "runs" / "smollm2-long"


def load_dataset(path: Path = DATASET) -> tuple[list[DraftExample], list[DraftExample]]:
    """(train, held-out) examples of the committed dataset."""
    data = json.loads(gzip.decompress(path.read_bytes()))
    return examples_from_json(data["train"]), examples_from_json(data["heldout"])


def save_dataset(train: list[DraftExample], held: list[DraftExample], path: Path = DATASET) -> int:
    """Store a recipe's regenerated examples (token ids only) as the committed dataset; bytes written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = gzip.compress(json.dumps({"train": examples_to_json(train), "heldout": examples_to_json(held)},
                                    separators=(",", ":")).encode(), mtime=0)
    path.write_bytes(blob)
    return len(blob)


def warm_start(trainer, name: str) -> bool:
    """Load the shipped drafter `name` into a fresh trainer's drafter; False when none is shipped."""
    directory = SHIPPED / name
    if not (directory / "model.safetensors").is_file():
        return False
    loaded = type(trainer.drafter).from_pretrained(directory, trainer.target)
    missing, unexpected = trainer.drafter.load_state_dict({k: v.float() for k, v in loaded.state_dict().items()},
                                                          strict=False)
    # an option the shipped drafter lacks may add weights that start from their own (neutral) init
    new = {name for name, _ in trainer.drafter.named_parameters()} - set(loaded.state_dict())
    if unexpected or set(missing) - new:
        raise RuntimeError(f"shipped drafter {name} does not fit this run (missing {missing}, unexpected {unexpected})")
    return True


def heldout_agreement(drafter_dir: Path, name: str, target, held: list[DraftExample],
                      recipe: SmolRecipe) -> list[float | None]:
    """The trainer's held-out agreement by depth (0..eval_depth) of the drafter in `drafter_dir`, in
    fp32 (drafters trained in bf16 or shipped in fp16 compare on equal terms)."""
    return _held_out_evaluation(drafter_dir, name, target, held, recipe, by_sequence=False)


def heldout_agreement_by_sequence(drafter_dir: Path, name: str, target, held: list[DraftExample],
                                  recipe: SmolRecipe) -> list[tuple[list[float], list[float]]]:
    """The same evaluation's (hits, counts) by depth for each sequence of `held` (their sums give
    `heldout_agreement`): for confidence intervals by resampling sequences."""
    return _held_out_evaluation(drafter_dir, name, target, held, recipe, by_sequence=True)


def drafter_options(loaded) -> tuple[dict, torch.Tensor | None]:
    """The options a loaded drafter was built with (a long run may have changed some, e.g.
    lsa_layer_stride), with its reduced draft vocabulary's size, and that vocabulary (or None):
    what a trainer needs to rebuild it."""
    options = {key: getattr(loaded.config, key) for key in type(loaded.config).OPTIONS if key != "tli"}
    vocab = loaded.draft_vocab
    if vocab is not None:
        options["draft_vocab_size"] = int(vocab.numel())
    return options, vocab


def _held_out_evaluation(drafter_dir: Path, name: str, target, held: list[DraftExample], recipe: SmolRecipe,
                         by_sequence: bool):
    import tempfile

    from vllm_moa.models import load_drafter
    from vllm_moa.training.trainer import TrainConfig, Trainer

    loaded = load_drafter(drafter_dir, target)
    kind, tli, _ = DRAFTERS[name]
    options, vocab = drafter_options(loaded)
    with tempfile.TemporaryDirectory() as out:
        config = TrainConfig(drafter=kind, tli=tli, drafter_options=options, steps=1, batch_size=8,
                             max_length=recipe.max_length, eval_depth=recipe.eval_depth, output_dir=out,
                             precision="fp32", seed=recipe.seed, progress=False)
        trainer = Trainer(config, target, held, held, draft_vocab=vocab)
        trainer.drafter.load_state_dict({k: v.float() for k, v in loaded.state_dict().items()})
        return trainer.evaluate_by_sequence() if by_sequence else trainer.evaluate()


def run_tokens(train: list[DraftExample], config: dict, steps: int) -> int:
    """The target tokens a run of `config` (a checkpoint's TrainConfig dump) trained on in its first
    `steps` steps: exact, since the data order is a function of (seed, step) (and of the short
    sequences' repeats, for runs that set them)."""
    repeats = sequence_repeats(train, config["max_length"], config.get("short_length", 0),
                               config.get("short_repeats", 1))
    return sum(min(len(train[i].input_ids), config["max_length"])
               for step in range(steps)
               for i in global_batch_indices(len(train), config["batch_size"], step, config["seed"], repeats))


def shipped_earlier(checkpoint: Path, runs: list[dict]) -> dict | None:
    """The state of the checkpoint of this run that the card's last long run shipped ({step,
    train_seconds, train_cpu_seconds}), when `checkpoint` continues that run; else None. Same run:
    the sibling checkpoint of that name is there and recorded the CPU time the card did."""
    if not runs:
        return None
    last = runs[-1]
    sibling = checkpoint.parent / last.get("checkpoint", "")
    if sibling == checkpoint or not (sibling / "trainer_state.pt").is_file():
        return None
    state = torch.load(sibling / "trainer_state.pt", map_location="cpu", weights_only=True)
    cpu = float(state.get("train_cpu_seconds", 0.0))
    if round(cpu, 1) != round(float(last.get("train_cpu_seconds", -1.0)), 1):
        return None
    return {"step": int(state["step"]), "train_seconds": float(state.get("train_seconds", 0.0)),
            "train_cpu_seconds": cpu}


def ship_checkpoint(name: str, checkpoint: Path, target, train: list[DraftExample], held: list[DraftExample],
                    recipe: SmolRecipe, destination: Path = SHIPPED) -> dict:
    """Ship a long-run checkpoint of drafter `name`: fp16 weights into destination/name, and the
    card's entry for it (card.json, README.md) with the run and the held-out agreement before and
    after. Returns the entry."""
    code_state = provenance()  # before the assets change
    state = torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=True)
    config, steps = state["config"], int(state["step"])
    before = heldout_agreement(destination / name, name, target, held, recipe)
    after = heldout_agreement(checkpoint / "drafter", name, target, held, recipe)
    card = json.loads((destination / "card.json").read_text())
    entry = card["drafters"][name]
    # a run that goes on past a checkpoint shipped before: the card records only what came after it
    since = shipped_earlier(checkpoint, long_runs(entry))
    done = {"step": 0, "train_seconds": 0.0, "train_cpu_seconds": 0.0} if since is None else since
    tokens = run_tokens(train, config, steps) - run_tokens(train, config, done["step"])
    write_fp16(checkpoint / "drafter", destination / name)
    entry["heldout_agreement_by_depth"] = after
    run = {
        "steps": steps, "from_step": done["step"], "batch_size": config["batch_size"], "sequences": len(train),
        "target_tokens": tokens, "lr": config["lr"], "schedule_steps": config["steps"], "precision": config["precision"],
        "train_seconds_recorded": round(float(state.get("train_seconds", 0.0)) - done["train_seconds"], 1),
        "recorded_since_step": max(done["step"], steps - int(state.get("timed_steps", 0))), "cores": os.cpu_count(),
        "train_cpu_seconds": round(float(state.get("train_cpu_seconds", 0.0)) - done["train_cpu_seconds"], 1),
        "lsa_layer_stride": int(config["drafter_options"].get("lsa_layer_stride", 1)),
        "anchor_spacing": [config.get("anchor_min", DEFAULT_ANCHORS[0]), config.get("anchor_max", DEFAULT_ANCHORS[1])],
        "kl_weight": config.get("kl_weight", DEFAULT_KL_WEIGHT),
        "heldout_agreement_before": before, "checkpoint": checkpoint.name, "provenance": code_state,
    }
    entry["long_runs"] = long_runs(entry) + [run]  # the runs before this one stay in the card
    entry.pop("long_run", None)  # the single-run form of older cards
    (destination / "card.json").write_text(json.dumps(card, indent=2))
    (destination / "README.md").write_text(model_card(card))
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", choices=sorted(DRAFTERS), default="moa-tli0")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK)
    parser.add_argument("--hours", type=float, default=None, help="stop (with a checkpoint) after this long")
    parser.add_argument("--cpu-hours", type=float, default=None,
                        help="stop (with a checkpoint) once the run's recorded training CPU time, resumed runs "
                             "included, reaches this: equal-cost ablations")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: one per core)")
    parser.add_argument("--steps", type=int, default=20_000, help="length of the LR schedule")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.05)
    parser.add_argument("--sequences", type=int, default=0, help="train on the first N sequences (0: all)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--checkpoint-minutes", type=float, default=10.0)
    parser.add_argument("--keep-checkpoints", type=int, default=100,
                        help="checkpoints kept (~80 MB each): held-out agreement against training tokens is measured "
                             "on them afterwards (benchmarks/long_run_curve.py)")
    parser.add_argument("--lsa-layer-stride", type=int, default=None,
                        help="MoA: LSA reads every n-th target layer with the last (its own run directory; default: "
                             "the shipped drafter's, so that a warm start keeps what its weights were trained for)")
    parser.add_argument("--final-hidden-rows", action="store_true",
                        help="MoA: CA rows also carry the target's final hidden state (option final_hidden_rows; its "
                             "own run directory; a warm start adds the zero-initialised projection)")
    parser.add_argument("--kl-weight", type=float, default=DEFAULT_KL_WEIGHT,
                        help="weight of the forward-KL loss (default: the reference's; another value: its own run "
                             "directory)")
    parser.add_argument("--anchors", type=int, nargs=2, default=DEFAULT_ANCHORS, metavar=("MIN", "MAX"),
                        help="anchor spacing in responses, drawn per sample (the reference's 6 14: positions k tokens "
                             "past an anchor train draft depth k; another range: its own run directory)")
    parser.add_argument("--long-data", action="store_true",
                        help="also train on the long on-policy sequences (smollm2_long_data.py; its own run directory)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="tokens of a sequence trained on (default: the recipe's 256, 1,280 with --long-data)")
    parser.add_argument("--short-repeats", type=int, default=1,
                        help="with --long-data: an epoch draws each short sequence (TrainConfig short_length) this "
                             "many times, so that the long ones do not outweigh them (its own run directory)")
    parser.add_argument("--from-scratch", action="store_true", help="no warm start from the shipped drafter")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--ship", action="store_true", help="ship the newest checkpoint (or --checkpoint), no training")
    parser.add_argument("--checkpoint", type=Path, default=None, help="with --ship: this step-NNNNNN directory")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from vllm_moa.target import TargetModel
    from vllm_moa.targets import fetch_smollm2
    from vllm_moa.training.features import build_feature_cache
    from vllm_moa.training.trainer import TrainConfig, Trainer

    recipe = SmolRecipe()
    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
    code_state = provenance()
    target_dir = fetch_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = TargetModel.from_pretrained(target_dir)
    train, held = load_dataset()
    if args.sequences:
        train = train[: args.sequences]
    if args.long_data:
        if not LONG_DATASET.is_file():
            parser.error(f"--long-data: {LONG_DATASET} is missing; build it with python -m "
                         "vllm_moa.recipes.smollm2_long_data")
        train = train + load_dataset(LONG_DATASET)[0]
    max_length = args.max_length or (LONG_MAX_LENGTH if args.long_data else recipe.max_length)
    if args.lsa_layer_stride is None:
        shipped_config = SHIPPED / args.drafter / "config.json"
        args.lsa_layer_stride = (json.loads(shipped_config.read_text()).get("lsa_layer_stride", 1)
                                 if shipped_config.is_file() else 1)
    run_name = (args.drafter + (f"-stride{args.lsa_layer_stride}" if args.lsa_layer_stride != 1 else "")
                + ("-hidden" if args.final_hidden_rows else "")
                + (f"-kl{args.kl_weight:g}" if args.kl_weight != DEFAULT_KL_WEIGHT else "")
                + (f"-anchors{args.anchors[0]}-{args.anchors[1]}" if tuple(args.anchors) != DEFAULT_ANCHORS else "")
                + (f"-long{max_length}" if args.long_data or max_length != recipe.max_length else "")
                + (f"-short{args.short_repeats}" if args.short_repeats != 1 else ""))
    if args.ship:
        checkpoints = args.work / run_name / "checkpoints"
        checkpoint = args.checkpoint or checkpoints / (checkpoints / "latest").read_text().strip()
        entry = ship_checkpoint(args.drafter, checkpoint, target, train, held, recipe)
        print(json.dumps({k: v for k, v in entry.items() if k != "provenance"}, indent=2))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    features_dir = args.work / (f"features-{len(train)}" + ("-long" if args.long_data else "")
                                + (f"-{max_length}" if max_length != recipe.max_length else ""))
    features = build_feature_cache(target, train, features_dir, max_length,
                                   tli_depths=(1,), progress=not args.no_progress)
    vocab = draft_vocabulary(train, recipe.draft_vocab_size, target.vocab_size, [tokenizer.eos_token_id])
    kind, tli, options = DRAFTERS[args.drafter]
    if kind != "independent":
        options = {**options, "draft_vocab_size": len(vocab)}
    if kind == "moa":
        options = {**options, "lsa_layer_stride": args.lsa_layer_stride, "final_hidden_rows": args.final_hidden_rows}
    elif args.lsa_layer_stride != 1 or args.final_hidden_rows:
        parser.error("--lsa-layer-stride and --final-hidden-rows are options of MoA drafters")
    out = args.work / run_name
    # a warm start skips the SA staircase curriculum: the shipped drafter has been through it, and
    # re-entering it would train on masks evaluation never uses
    warm = not args.from_scratch and (SHIPPED / args.drafter / "model.safetensors").is_file()
    config = TrainConfig(drafter=kind, tli=tli, drafter_options=options, steps=args.steps, batch_size=args.batch,
                         lr=args.lr, min_lr_ratio=args.min_lr_ratio, kl_weight=args.kl_weight,
                         anchor_min=args.anchors[0], anchor_max=args.anchors[1], warmup_steps=30,
                         max_length=max_length, short_repeats=args.short_repeats,
                         eval_depth=recipe.eval_depth, output_dir=str(out), checkpoint_every=10**9,
                         checkpoint_minutes=args.checkpoint_minutes, keep_checkpoints=args.keep_checkpoints,
                         precision=args.precision, seed=recipe.seed,
                         staircase_until=0.0 if warm else 0.05, compile=True,  # from scratch: 5% of the schedule
                         progress=not args.no_progress, log_every=10)
    trainer = Trainer(config, target, features.examples(), held, features=features,
                      draft_vocab=vocab if kind != "independent" else None)
    resume = (out / "checkpoints" / "latest").is_file()
    started_from = "checkpoint" if resume else ("shipped drafter" if warm and warm_start(trainer, args.drafter)
                                                else "scratch")
    deadline = None if args.hours is None else time.time() + 3600 * args.hours
    cpu_budget = None if args.cpu_hours is None else 3600 * args.cpu_hours
    result = trainer.train(resume=resume, deadline=deadline, cpu_budget_s=cpu_budget)
    report = {"drafter": args.drafter, "started_from": started_from, "steps": result.steps,
              "sequences": len(train), "batch": args.batch, "max_length": max_length, "long_data": args.long_data,
              "heldout_agreement_by_depth": result.eval_agreement, "wall_time_s_this_run": round(result.wall_time_s, 1),
              "train_cpu_seconds": round(trainer.train_cpu_seconds, 1),
              "provenance": code_state}
    (out / "long_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
