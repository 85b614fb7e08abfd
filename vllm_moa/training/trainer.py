"""K-step-bounded drafter training with online target features.

Each step: the frozen target runs a no-grad forward over the batch (its per-layer K/V, hidden
states and logits are the drafter's inputs and labels, nothing is written to disk); anchors are
drawn per sample; the drafter runs its training forward; loss = KL + SmoothL1 over response
positions; AdamW with warm-up and linear decay, gradient clipping, optional bf16 autocast.

All randomness of a step (which examples, anchor spacing, staircase coin) is a function of
(seed, step, example index), so a resumed run and a run split over N workers (distributed.py)
see exactly the data a single uninterrupted process would.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from vllm_moa import registry as kinds
from vllm_moa.config import DrafterTargetMismatch
from vllm_moa.cpu_flags import native_bf16
from vllm_moa.models import Drafter, TrainingBatchView
from vllm_moa.models.base import DraftOutput, replace_directory
from vllm_moa.models.masks import anchor_flags, draft_depth, last_anchor
from vllm_moa.speculators_format import write_speculators_config
from vllm_moa.target import TargetModel, TargetOutput
from vllm_moa.training.config import TrainConfig
from vllm_moa.training.data import (
    DatasetError,
    DraftExample,
    TrainingBatch,
    collate,
    global_batch_indices,
    sequence_repeats,
    validate_examples,
)
from vllm_moa.training.features import FeatureCache
from vllm_moa.training.losses import agreement_by_depth, agreement_of_sequences, drafter_loss


class CheckpointError(RuntimeError):
    """A checkpoint to resume from is missing or unreadable."""


@dataclass
class TrainResult:
    output_dir: Path
    drafter_dir: Path
    steps: int
    final_loss: float
    eval_agreement: list[float] = field(default_factory=list)
    wall_time_s: float = 0.0


def build_drafter(config: TrainConfig, target: TargetModel) -> Drafter:
    """A freshly initialised drafter of `config.drafter` kind for `target` (seeded)."""
    options = dict(config.drafter_options)
    kind = kinds.get(config.drafter)
    config_class = kind.config_class
    for key, value in options.items():
        config_class.check_option(key, value, "drafter_options")  # a DrafterConfigError (ValueError) naming it
    options.update(kind.training_options(config))
    try:
        drafter_config = config_class(target=target.signature, **options)
        drafter_config.check_values("drafter_options")
        drafter_config.check_draft_vocab("drafter_options")
    except TypeError as err:
        raise ValueError(f"drafter_options: {err}") from None
    torch.manual_seed(config.seed)
    drafter = kind.drafter_class(drafter_config)
    drafter.init_from_target(target)
    kind.prepare_training(drafter, config)
    return drafter


def _sample_rng(seed: int, step: int, index: int) -> random.Random:
    digest = hashlib.sha256(f"{seed}/{step}/{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def staircase_probability(config: TrainConfig, step: int) -> float:
    if not config.staircase or config.staircase_until == 0:
        return 0.0
    return max(0.0, 1.0 - step / (config.staircase_until * config.steps))


def anchors_for(batch: TrainingBatch, indices: Sequence[int], config: TrainConfig, step: int,
                p_staircase: float) -> tuple[Tensor, Tensor]:
    """Per-sample anchor spacing in [anchor_min, anchor_max] and staircase coin -> (s [B, T], staircase [B])."""
    t = batch.input_ids.shape[1]
    flags, stairs = [], []
    for row, index in enumerate(indices):
        rng = _sample_rng(config.seed, step, index)
        every = rng.randint(config.anchor_min, config.anchor_max)
        flags.append(anchor_flags(t, int(batch.prompt_lengths[row]), every))
        stairs.append(rng.random() < p_staircase)
    return last_anchor(torch.stack(flags)), torch.tensor(stairs, dtype=torch.bool)


def _lr_lambda(config: TrainConfig):
    def schedule(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        remaining = max(1, config.steps - config.warmup_steps)
        progress = min(1.0, (step - config.warmup_steps) / remaining)
        return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * (1.0 - progress)

    return schedule


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def uses_bf16(precision: str, device: torch.device) -> bool:
    """Whether training autocasts to bf16: asked for, or "auto" where the hardware computes bf16
    (CUDA that supports it; CPUs with avx512_bf16 / AMX: elsewhere bf16 is emulated and slower)."""
    if precision != "auto":
        return precision == "bf16"
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and native_bf16()


def autocast_context(precision: str, device: torch.device):
    use_bf16 = uses_bf16(precision, device)
    if not use_bf16:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


class Trainer:
    """Trains one drafter against one frozen target; rank 0 writes checkpoints and metrics."""

    def __init__(self, config: TrainConfig, target: TargetModel, train_examples: Sequence[DraftExample],
                 eval_examples: Sequence[DraftExample] = (), rank: int = 0, world_size: int = 1,
                 features: FeatureCache | None = None, draft_vocab: Sequence[int] | Tensor | None = None) -> None:
        """`features`: an offline feature cache of exactly `train_examples` (its examples()), read
        instead of running the target on training batches (evaluation stays online).
        `draft_vocab`: the reduced draft vocabulary's target ids (drafter_options draft_vocab_size)."""
        validate_examples(train_examples, "training data")
        if features is not None:
            features.check_target(target)
            if len(features) != len(train_examples):
                raise DatasetError(f"feature cache holds {len(features)} sequences, training data {len(train_examples)}: "
                                   "build the cache from these examples")
        untrainable = sum(1 for e in train_examples if min(len(e.input_ids), config.max_length) - e.prompt_length < 1)
        if untrainable:
            raise DatasetError(
                f"{untrainable} of {len(train_examples)} training sequences have no response token within "
                f"max_length={config.max_length} (their prompts are that long): raise max_length or shorten prompts"
            )
        if config.batch_size % world_size:
            raise ValueError(f"batch_size {config.batch_size} must be divisible by the {world_size} workers")
        self.config = config
        self.target = target
        self.train_examples = list(train_examples)
        self.repeats = sequence_repeats(self.train_examples, config.max_length, config.short_length,
                                        config.short_repeats)
        self.eval_examples = list(eval_examples)
        self.rank, self.world_size = rank, world_size
        self.device = resolve_device(config.device)
        self.output_dir = Path(config.output_dir)
        self.checkpoint_root = self.output_dir / "checkpoints"
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self.features = features
        self.drafter = build_drafter(config, target).to(self.device)
        if config.compile:  # in place: parameter names (checkpoints) stay those of the eager modules
            for block in self.drafter.children():
                block.compile(dynamic=True)
        if draft_vocab is not None:
            self.drafter.set_draft_vocab(torch.as_tensor(draft_vocab))
        elif self.drafter.draft_vocab is not None:
            raise ValueError("drafter_options set draft_vocab_size: pass the draft vocabulary's token ids (draft_vocab)")
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(config))
        self.step = 0
        # training time of this run and the runs it resumed, over the last `timed_steps` steps
        # (checkpoints written before the time was recorded carry none)
        # and the process CPU time of those steps (all threads; a paused process accrues none)
        self.train_seconds, self.timed_steps, self.train_cpu_seconds = 0.0, 0, 0.0

    # -- distributed helpers ------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def _all_reduce(self, tensor: Tensor) -> Tensor:
        if self.distributed:
            dist.all_reduce(tensor)
        return tensor

    def _all_reduce_gradients(self) -> None:
        """Sum gradients over workers in one flat buffer (losses are pre-scaled by the global count)."""
        if not self.distributed:
            return
        grads = [p.grad for p in self.drafter.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    # -- one step -----------------------------------------------------------------------------
    def _local_indices(self, step: int) -> list[int]:
        indices = global_batch_indices(len(self.train_examples), self.config.batch_size, step, self.config.seed,
                                       self.repeats)
        share = self.config.batch_size // self.world_size
        return indices[self.rank * share : (self.rank + 1) * share]

    def _target_logits(self, target_out: TargetOutput, output: DraftOutput) -> Tensor:
        """The target's logits over the drafter's vocabulary [B, T, N] (N = V without a reduced one)."""
        if target_out.logits is not None:
            return target_out.logits if output.vocab is None else target_out.logits.index_select(-1, output.vocab)
        with torch.no_grad():
            return self.drafter.vocab_logits(target_out.hidden_states[-1], self.target)

    def _forward(self, examples: Sequence[DraftExample], indices: Sequence[int], step: int, p_staircase: float,
                 eval_depth: int | None = None, cached: bool = False):
        batch = collate(examples, max_length=self.config.max_length).to(self.device)
        s, staircase = anchors_for(batch, indices, self.config, step, p_staircase)
        s, staircase = s.to(self.device), staircase.to(self.device)
        view = TrainingBatchView(batch.input_ids, s, staircase, batch.lengths)
        with autocast_context(self.config.precision, self.device):
            if cached:
                target_out = self.features.target_output(indices, batch.input_ids.shape[1], self.device,
                                                         self.target.dtype)
            else:
                with torch.no_grad():
                    target_out = self.target(batch.input_ids)
            options = {} if eval_depth is None else kinds.kind_of(self.drafter).evaluation_options(eval_depth)
            output = self.drafter.training_forward(view, self.target, target_out, **options)
        parts = drafter_loss(output, self._target_logits(target_out, output), batch.loss_mask,
                             self.config.kl_weight, self.config.feature_weight)
        return batch, s, output, target_out, parts

    def train_step(self) -> dict[str, Any]:
        config, step = self.config, self.step
        started, cpu_started = time.perf_counter(), time.process_time()
        indices = self._local_indices(step)
        examples = [self.train_examples[i] for i in indices]
        self.drafter.train()
        batch, s, output, target_out, parts = self._forward(examples, indices, step,
                                                            staircase_probability(config, step),
                                                            cached=self.features is not None)
        global_count = self._all_reduce(parts.count.detach().clone()).clamp_min(1.0)
        (parts.total / global_count).backward()
        self._all_reduce_gradients()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), config.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        hits, counts = agreement_by_depth(output.tokens(), target_out.greedy_tokens(), draft_depth(s),
                                          batch.loss_mask, config.eval_depth)
        totals = self._all_reduce(torch.stack([parts.total.detach(), parts.kl, parts.feature]).float())
        hits, counts = self._all_reduce(hits), self._all_reduce(counts)
        self.step += 1
        self.train_seconds += time.perf_counter() - started
        self.train_cpu_seconds += time.process_time() - cpu_started
        self.timed_steps += 1
        return {
            "step": self.step,
            "loss": (totals[0] / global_count).item(),
            "kl": (totals[1] / global_count).item(),
            "feature": (totals[2] / global_count).item(),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "p_staircase": staircase_probability(config, step),
            "agreement": [round((h / c).item(), 4) if c > 0 else None for h, c in zip(hits, counts)],
            "train_cpu_seconds": round(self.train_cpu_seconds, 3),
        }

    # -- evaluation ---------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, examples: Sequence[DraftExample] | None = None, batch_size: int = 8) -> list[float | None]:
        """Top-1 agreement with the target at draft depths 0..eval_depth (causal SA, exact
        EAGLE feature autoregression)."""
        return agreement_of_sequences(self.evaluate_by_sequence(examples, batch_size))

    @torch.no_grad()
    def evaluate_by_sequence(self, examples: Sequence[DraftExample] | None = None,
                             batch_size: int = 8) -> list[tuple[list[float], list[float]]]:
        """`evaluate`'s counts per sequence: (hits, counts) at depths 0..eval_depth for each
        example, in order (the same anchors as `evaluate`: sums of these are its figures). For
        confidence intervals by resampling sequences."""
        examples = list(self.eval_examples if examples is None else examples)
        self.drafter.eval()
        depth = self.config.eval_depth
        out: list[tuple[list[float], list[float]]] = []
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            indices = list(range(10**9 + start, 10**9 + start + len(chunk)))  # eval-only rng stream
            batch, s, output, target_out, _ = self._forward(chunk, indices, 0, 0.0, eval_depth=depth)
            drafted, wanted, depths = output.tokens(), target_out.greedy_tokens(), draft_depth(s)
            for row in range(len(chunk)):
                h, c = agreement_by_depth(drafted[row : row + 1], wanted[row : row + 1], depths[row : row + 1],
                                          batch.loss_mask[row : row + 1], depth)
                out.append((h.tolist(), c.tolist()))
        return out

    # -- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Write checkpoints/step-NNNNNN atomically, then point `latest` at it; prune old ones."""
        self.checkpoint_root.mkdir(parents=True, exist_ok=True)
        final = self.checkpoint_root / f"step-{self.step:06d}"
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.checkpoint_root))
        self.drafter.save_pretrained(tmp / "drafter")
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "step": self.step, "config": self.config.model_dump(mode="json"),
                    "train_seconds": self.train_seconds, "timed_steps": self.timed_steps,
                    "train_cpu_seconds": self.train_cpu_seconds}, tmp / "trainer_state.pt")
        replace_directory(tmp, final)
        _write_atomic(self.checkpoint_root / "latest", final.name)
        # prune older checkpoints of this run only: never the new one, never a later step (a
        # checkpoint from a run this one was resumed behind stays for the user to decide)
        older = sorted(d for d in self.checkpoint_root.glob("step-*") if d != final and int(d.name[5:]) < self.step)
        for old in older[: max(0, len(older) - (self.config.keep_checkpoints - 1))]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load_checkpoint(self, path: str | Path | None = None) -> None:
        """Resume from `path` (a step-NNNNNN directory) or the run's `latest` checkpoint."""
        if path is None:
            pointer = self.checkpoint_root / "latest"
            if not pointer.is_file():
                raise CheckpointError(f"no checkpoint to resume from: {pointer} does not exist")
            path = self.checkpoint_root / pointer.read_text().strip()
        path = Path(path)
        state_file, drafter_dir = path / "trainer_state.pt", path / "drafter"
        if not state_file.is_file() or not drafter_dir.is_dir():
            raise CheckpointError(f"checkpoint {path} is missing or incomplete (need trainer_state.pt and drafter/)")
        try:
            state = torch.load(state_file, map_location=self.device, weights_only=True)
            saved = state["config"]
        except Exception as err:  # a corrupt file may fail in torch or pickle
            raise CheckpointError(f"checkpoint {path} is corrupt: {type(err).__name__}: {err}") from None
        current = self.config.model_dump(mode="json")
        for key in ("drafter", "tli", "drafter_options"):
            if saved.get(key) != current[key]:
                raise CheckpointError(
                    f"checkpoint {path} was trained with {key}={saved.get(key)!r}, this run has "
                    f"{key}={current[key]!r}: resume with the same drafter, or start a new output_dir"
                )
        try:
            loaded = type(self.drafter).from_pretrained(drafter_dir, self.target)
            weights = {k: v.to(self.device, torch.float32) for k, v in loaded.state_dict().items()}
            self.drafter.load_state_dict(weights)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.step = int(state["step"])
            self.train_seconds = float(state.get("train_seconds", 0.0))  # absent before they were recorded
            self.timed_steps = int(state.get("timed_steps", 0))
            self.train_cpu_seconds = float(state.get("train_cpu_seconds", 0.0))
        except DrafterTargetMismatch as err:
            raise CheckpointError(f"checkpoint {path} was trained for another target: {err}") from None
        except Exception as err:  # safetensors, shapes, optimizer state
            raise CheckpointError(f"checkpoint {path} is corrupt: {type(err).__name__}: {err}") from None
        self._truncate_metrics(self.step)

    def _truncate_metrics(self, step: int) -> None:
        """After a resume, drop metrics of steps that will be run again."""
        if self.rank != 0 or not self.metrics_path.is_file():
            return
        lines = self.metrics_path.read_text().splitlines()
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
        if len(kept) != len(lines):
            _write_atomic(self.metrics_path, "".join(line + "\n" for line in kept))

    # -- the loop -----------------------------------------------------------------------------
    def train(self, resume: bool | str | Path = False, deadline: float | None = None,
              cpu_budget_s: float | None = None) -> TrainResult:
        """Train to config.steps, or until time.time() passes `deadline` or the run's recorded
        training CPU time (resumed runs included) reaches `cpu_budget_s` (then with a checkpoint:
        the run resumes from there). A CPU budget is what equal-cost ablations compare at."""
        from tqdm.auto import tqdm

        if (deadline is not None or cpu_budget_s is not None) and self.distributed:
            raise ValueError("a deadline or CPU budget applies to single-process training (workers would stop at different steps)")
        if resume:
            self.load_checkpoint(None if resume is True else resume)
        config = self.config
        is_main = self.rank == 0
        if is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "train_config.json").write_text(json.dumps(config.model_dump(mode="json"), indent=2))
        started = last_checkpoint = time.time()
        timed = config.checkpoint_minutes is not None and not self.distributed  # ranks would disagree on time
        last: dict[str, Any] = {}
        bar = tqdm(total=config.steps, initial=self.step, desc=f"train {config.drafter}",
                   disable=not (config.progress and is_main))
        with bar:
            def out_of_time() -> bool:
                return ((deadline is not None and time.time() >= deadline)
                        or (cpu_budget_s is not None and self.train_cpu_seconds >= cpu_budget_s))

            while self.step < config.steps and not out_of_time():
                last = self.train_step()
                if not math.isfinite(last["loss"]):
                    raise FloatingPointError(f"loss became {last['loss']} at step {self.step}; lower the lr")
                bar.update(1)
                if is_main and (self.step % config.log_every == 0 or self.step == config.steps):
                    bar.set_postfix(loss=f"{last['loss']:.3f}", acc1=last["agreement"][1])
                    with self.metrics_path.open("a") as f:
                        f.write(json.dumps(last) + "\n")
                overdue = timed and time.time() - last_checkpoint >= 60 * config.checkpoint_minutes
                overdue = overdue or out_of_time()
                if self.step % config.checkpoint_every == 0 or self.step == config.steps or overdue:
                    last_checkpoint = time.time()
                    if is_main:
                        self.save_checkpoint()
                    if self.distributed:
                        dist.barrier()
        eval_agreement = self.evaluate() if self.eval_examples else []
        drafter_dir = self.output_dir / "drafter"
        if is_main:
            self.drafter.save_pretrained(drafter_dir)
            if type(self.drafter.config).SPECULATORS_ALGORITHM and self.target.directory is not None:
                # `vllm serve <drafter dir>` serves the target it was trained for, with it
                write_speculators_config(drafter_dir, str(self.target.directory), [self.target.architecture])
            summary = {"steps": self.step, "final_loss": last.get("loss"), "eval_agreement_by_depth": eval_agreement,
                       "wall_time_s": round(time.time() - started, 1), "world_size": self.world_size}
            (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return TrainResult(self.output_dir, drafter_dir, self.step, float(last.get("loss", float("nan"))),
                           eval_agreement, time.time() - started)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
