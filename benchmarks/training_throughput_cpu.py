"""MoA drafter training throughput on CPU, SmolLM2-135M-Instruct target: real (unpadded) target
tokens per second of training steps (offline feature cache, the recipe's TLI = 0 drafter, its
batches of 8 sequences of the committed regenerated dataset), measured in one run for a ladder of
configurations, each with a breakdown of a step (feature read, LSA, SA, CA, rest of the forward,
loss + backward, optimizer) and the CPU's flags (bf16 is native on avx512_bf16 / AMX only):

    before            fp32, LSA over every position of the padded batch (the code before)
    + skip padding    LSA over real tokens only (TrainingBatchView.lengths)
    + bf16            autocast where the CPU has native bf16, else fp32 (the "auto" precision)
    + compile         torch.compile of the drafter's blocks (TrainConfig.compile)
    + LSA every 3rd   LSA reads every 3rd target layer with the last (lsa_layer_stride 3: 10 of 30)

    python -m benchmarks.training_throughput_cpu [--steps 8] [--sequences 256]

Writes benchmarks/results/training_throughput_cpu.{json,png} with provenance.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from benchmarks.provenance import ROOT, provenance  # noqa: E402
from vllm_moa.cpu_flags import isa_summary, native_bf16  # noqa: E402
from vllm_moa.models.base import TrainingBatchView  # noqa: E402
from vllm_moa.recipes.smollm2 import DRAFTERS, SmolRecipe, draft_vocabulary  # noqa: E402
from vllm_moa.recipes.smollm2_long import load_dataset  # noqa: E402
from vllm_moa.training.data import global_batch_indices  # noqa: E402

# name -> (skip padding in LSA, precision, compile, LSA layer stride)
LADDER = {"before (fp32, padded LSA)": (False, "fp32", False, 1), "+ skip padding": (True, "fp32", False, 1),
          "+ bf16 (where native)": (True, "auto", False, 1), "+ compile": (True, "auto", True, 1),
          "+ LSA every 3rd layer": (True, "auto", True, 3)}


class PhaseTimer:
    """Wall time of the drafter's modules' forwards (hooks) within a step."""

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._start: dict[str, float] = {}
        for name, module in modules.items():
            module.register_forward_pre_hook(lambda *_, n=name: self._start.__setitem__(n, time.perf_counter()))
            module.register_forward_hook(lambda *_, n=name: self._add(n))

    def _add(self, name: str) -> None:
        self.seconds[name] += time.perf_counter() - self._start.pop(name)


def _timed(phases: dict[str, float], name: str, fn):
    """fn, adding its wall time to phases[name] at every call."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        phases[name] += time.perf_counter() - start
        return out

    return wrapper


def timed_steps(trainer, steps: int, breakdown: bool) -> tuple[float, dict[str, float]]:
    """Mean seconds per step over `steps` steps (after 2 warm-up steps), and the phase breakdown."""
    for _ in range(2):
        trainer.train_step()
    timer = PhaseTimer({"LSA": trainer.drafter.lsa, "SA": trainer.drafter.sa, "CA": trainer.drafter.ca}) \
        if breakdown else None
    phases: dict[str, float] = defaultdict(float)
    if breakdown:  # time the trainer's pieces by wrapping them for this run
        trainer.features.target_output = _timed(phases, "feature read", trainer.features.target_output)
        trainer.optimizer.step = _timed(phases, "optimizer", trainer.optimizer.step)
        trainer.drafter.training_forward = _timed(phases, "drafter forward", trainer.drafter.training_forward)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    total = (time.perf_counter() - start) / steps
    if not breakdown:
        return total, {}
    modules = {k: v / steps for k, v in timer.seconds.items()}  # LSA, SA, CA: inside the drafter's forward
    forward = phases.pop("drafter forward") / steps
    out = {"feature read": phases["feature read"] / steps, **modules,
           "rest of forward (vocab head, TLI)": forward - sum(modules.values()),
           "loss, backward, clipping": total - forward - sum(v / steps for v in phases.values()),
           "optimizer": phases["optimizer"] / steps}
    return total, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration (after 2 warm-up)")
    parser.add_argument("--sequences", type=int, default=256, help="training sequences in the feature cache")
    parser.add_argument("--only", nargs="*", choices=list(LADDER), help="run these configurations only")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "training_throughput_cpu.json")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from vllm_moa.target import TargetModel
    from vllm_moa.targets import fetch_smollm2
    from vllm_moa.training.features import build_feature_cache
    from vllm_moa.training.trainer import TrainConfig, Trainer, uses_bf16

    recipe = SmolRecipe()
    record = {"provenance": provenance(benchmark="training_throughput_cpu", cpu_flags=isa_summary(),
                                       torch_threads=torch.get_num_threads(),
                                       args={k: str(v) for k, v in vars(args).items()}), "rows": []}
    target_dir = fetch_smollm2()
    target = TargetModel.from_pretrained(target_dir)
    train, _ = load_dataset()
    train = train[: args.sequences]
    eos = AutoTokenizer.from_pretrained(str(target_dir)).eos_token_id
    vocab = draft_vocabulary(train, recipe.draft_vocab_size, target.vocab_size, [eos])
    kind, tli, options = DRAFTERS["moa-tli0"]
    real_tokens = TrainingBatchView.real_tokens
    with tempfile.TemporaryDirectory() as tmp:
        features = build_feature_cache(target, train, Path(tmp) / "features", recipe.max_length, progress=False)
        examples = features.examples()
        for name in args.only or list(LADDER):
            skip_padding, precision, compiled, stride = LADDER[name]
            # "before": the view reports no lengths, so LSA runs over every (padded) position
            TrainingBatchView.real_tokens = real_tokens if skip_padding else (lambda self: None)
            config = TrainConfig(drafter=kind, tli=tli, drafter_options={**options, "draft_vocab_size": len(vocab),
                                                                           "lsa_layer_stride": stride},
                                 steps=10_000, batch_size=recipe.drafter_batch, lr=2e-3, warmup_steps=30,
                                 max_length=recipe.max_length, output_dir=str(Path(tmp) / "run"),
                                 precision=precision, compile=compiled, progress=False)
            trainer = Trainer(config, target, examples, features=features, draft_vocab=vocab)
            seconds, phases = timed_steps(trainer, args.steps, breakdown=True)
            # the real target tokens of the timed steps (steps 2 .. 2 + steps - 1 of the data order)
            tokens = sum(min(len(examples[i].input_ids), recipe.max_length)
                         for step in range(2, 2 + args.steps)
                         for i in global_batch_indices(len(examples), recipe.drafter_batch, step, config.seed))
            row = {"config": name, "skip_padding": skip_padding, "compile": compiled,
                   "precision": "bf16" if uses_bf16(precision, trainer.device) else "fp32",
                   "lsa_layer_stride": stride,
                   "seconds_per_step": round(seconds, 3), "target_tokens_per_s": round(tokens / args.steps / seconds, 1),
                   "real_tokens_per_step": round(tokens / args.steps, 1),
                   "phases_seconds": {k: round(v, 3) for k, v in phases.items()}}
            record["rows"].append(row)
            print(json.dumps(row), flush=True)
        TrainingBatchView.real_tokens = real_tokens
    base = record["rows"][0]["target_tokens_per_s"]
    for row in record["rows"]:
        row["speedup_over_before"] = round(row["target_tokens_per_s"] / base, 2)
    record["native_bf16"] = native_bf16()
    args.out.write_text(json.dumps(record, indent=2))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar([r["config"] for r in record["rows"]], [r["target_tokens_per_s"] for r in record["rows"]])
    a.tick_params(axis="x", labelsize=7)
    a.set_ylabel("target tokens / s (training)")
    a.set_title(f"{record['provenance']['cpu']}, {torch.get_num_threads()} threads")
    for i, row in enumerate(record["rows"]):
        bottom = 0.0
        for name, value in row["phases_seconds"].items():
            b.bar(i, value, bottom=bottom, label=name if i == 0 else None)
            bottom += value
    b.set_xticks(range(len(record["rows"])), [r["config"] for r in record["rows"]], fontsize=7)
    b.set_ylabel("seconds per step")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
