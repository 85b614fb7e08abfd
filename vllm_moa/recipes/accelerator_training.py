"""Training one SmolLM2 drafter within a wall-clock share, for the accelerator job
(recipes/smollm2_accelerator.py): the warm-started trainer, the probe that picks its batch (and
whether to `torch.compile` its blocks), and the timed run that writes the drafter in fp16."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from vllm_moa.recipes.smollm2 import DRAFTERS, SmolRecipe, write_fp16
from vllm_moa.recipes.smollm2_long import drafter_options, run_tokens
from vllm_moa.training.data import DraftExample

# each drafter's last long run on CPU (cards); MoA TLI=1 has none: MoA TLI=0's
KL_WEIGHTS = {"moa-tli0": 1.0, "moa-tli1": 1.0, "eagle": 0.1}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def make_trainer(name: str, target, train: list[DraftExample], held: list[DraftExample], shipped: Path, batch: int,
                 lr: float, max_length: int, output_dir: Path, compile_blocks: bool = False):
    """A trainer for `name`, warm-started from `shipped` where it holds that drafter, else from
    scratch (the recipe's shape, MoA's LSA over every 3rd layer, the staircase curriculum over the
    first 5% of the schedule); `compile_blocks`: TrainConfig.compile. -> (trainer, warm)"""
    from vllm_moa.models import load_drafter
    from vllm_moa.recipes.smollm2 import draft_vocabulary
    from vllm_moa.training.trainer import TrainConfig, Trainer

    kind, tli, options = DRAFTERS[name]
    warm = (shipped / name / "model.safetensors").is_file()
    if warm:
        loaded = load_drafter(shipped / name, target)
        options, vocab = drafter_options(loaded)
    else:
        vocab = torch.tensor(draft_vocabulary(train, SmolRecipe.draft_vocab_size, target.vocab_size,
                                              [target.hf_model.generation_config.eos_token_id]))
        options = {**options, "draft_vocab_size": int(vocab.numel()),
                   **({"lsa_layer_stride": 3} if kind == "moa" else {})}
    config = TrainConfig(drafter=kind, tli=tli, drafter_options=options, steps=10**6, batch_size=batch, lr=lr,
                         min_lr_ratio=0.05, kl_weight=KL_WEIGHTS[name], warmup_steps=30, max_length=max_length,
                         eval_depth=SmolRecipe.eval_depth, output_dir=str(output_dir),
                         staircase_until=0.0 if warm else 0.05, precision="auto", seed=0, progress=False,
                         compile=compile_blocks)
    trainer = Trainer(config, target, train, held, draft_vocab=vocab.cpu() if vocab is not None else None)
    if warm:  # the compiled blocks are the eager modules, compiled in place: the same parameter names
        trainer.drafter.load_state_dict({k: v.float() for k, v in loaded.state_dict().items()})
    return trainer, warm


def pick_batch(rates: list[tuple[int, float]], gain: float = 1.3) -> int:
    """The batch to train at, from (batch, target tokens/s) in increasing batch order: a bigger
    batch only where it trains on at least `gain` times the tokens/s of the one picked before it."""
    chosen, best = rates[0]
    for batch, rate in rates[1:]:
        if rate >= gain * best:
            chosen, best = batch, rate
    return chosen


def _time_steps(name: str, target, train: list[DraftExample], shipped: Path, batch: int, lr: float, max_length: int,
                work: Path, steps: int, compile_blocks: bool, untimed: int) -> dict:
    """Target tokens/s over `steps` - `untimed` steps of a throwaway trainer."""
    trainer, _ = make_trainer(name, target, train, [], shipped, batch, lr, max_length, work / f"probe-{name}",
                              compile_blocks)
    try:
        started = warm_up = time.time()
        for step in range(steps):
            if step == untimed:
                started = time.time()
                warm_up = started - warm_up
            trainer.train_step()  # ends in .item(): the device is done with the step
        elapsed = time.time() - started
        dump = trainer.config.model_dump(mode="json")
        tokens = run_tokens(train, dump, steps) - run_tokens(train, dump, untimed)
    finally:
        trainer = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"batch": batch, "compile": compile_blocks, "target_tokens_per_s": round(tokens / elapsed),
            "seconds_per_step": round(elapsed / (steps - untimed), 4), "warm_up_s": round(warm_up, 1)}


def probe_batch(name: str, target, train: list[DraftExample], shipped: Path, batches: list[int], lr: float,
                max_length: int, work: Path, steps: int = 12, gain: float = 1.3, compiled: bool = False,
                compile_gain: float = 1.15) -> tuple[int, bool, list[dict]]:
    """Time `steps` training steps of `name` at each batch (a throwaway trainer each, after `steps`
    untimed warm-up ones; the first 4 of each untimed) and pick one (`pick_batch`: a small drafter's
    step is mostly launch overhead). A batch that does not fit in memory ends the probe. `compiled`:
    then time the pick with its blocks compiled (its first steps untimed: the compilation), kept
    where it trains on `compile_gain` times the tokens/s or more; a compilation that fails is a row
    with its error, not a failed run. -> (batch, compile, rows)"""
    rows, rates = [], []
    batches = sorted(batches)
    for batch in [None, *batches]:  # None: the warm-up
        size = batches[0] if batch is None else batch
        try:
            row = _time_steps(name, target, train, shipped, size, lr, max_length, work, steps, False, 4)
        except torch.cuda.OutOfMemoryError:
            rows.append({"batch": batch, "error": "out of memory"})
            break
        if batch is None:
            continue
        rates.append((batch, row["target_tokens_per_s"]))
        rows.append(row)
        log(f"probe {name} batch {batch}: {row['target_tokens_per_s']:,} target tokens/s, {row['seconds_per_step']} s/step")
    chosen = pick_batch(rates, gain) if rates else batches[0]
    if not compiled or not rates:
        return chosen, False, rows
    try:
        row = _time_steps(name, target, train, shipped, chosen, lr, max_length, work, steps + 8, True, 8)
    except Exception as err:  # noqa: BLE001 - e.g. a backend the compiler does not handle: eager it is
        rows.append({"batch": chosen, "compile": True, "error": f"{type(err).__name__}: {str(err)[:300]}"})
        log(f"probe {name} compiled: {rows[-1]['error']}")
        return chosen, False, rows
    rows.append(row)
    log(f"probe {name} batch {chosen} compiled: {row['target_tokens_per_s']:,} target tokens/s "
        f"(compilation and warm-up {row['warm_up_s']} s)")
    return chosen, row["target_tokens_per_s"] >= compile_gain * dict(rates)[chosen], rows


def train_drafter(name: str, target, train: list[DraftExample], held: list[DraftExample], shipped: Path,
                  seconds: float, batch: int, lr: float, max_length: int, work: Path, out: Path,
                  compile_blocks: bool = False) -> dict:
    """Train `name` (see `make_trainer`) for `seconds`, then write it in fp16 to out/name."""
    from vllm_moa.training.trainer import uses_bf16

    trainer, warm = make_trainer(name, target, train, held, shipped, batch, lr, max_length, work / name,
                                 compile_blocks)
    config = trainer.config
    kind, tli = config.drafter, config.tli
    started = time.time()
    deadline, mark, history = started + seconds, None, []
    while time.time() < deadline and trainer.step < config.steps:
        metrics = trainer.train_step()
        if trainer.step == 20:  # the first steps are slow (allocator, kernel selection): timed from here
            mark = (trainer.step, time.time())
        elif mark is not None and trainer.step % 10 == 0:  # the schedule ends where the time share does
            rate = (time.time() - mark[1]) / (trainer.step - mark[0])
            config.steps = trainer.step + max(1, int((deadline - time.time()) / rate))
        if trainer.step % 50 == 0:
            history.append({k: metrics[k] for k in ("step", "loss", "kl", "feature", "lr", "agreement")})
            log(f"{name} step {trainer.step}/{config.steps} loss {metrics['loss']:.3f} agree {metrics['agreement'][1:4]}")
    elapsed = time.time() - started
    agreement = trainer.evaluate()
    tmp = work / name / "drafter"
    trainer.drafter.save_pretrained(tmp)
    write_fp16(tmp, out / name)
    dump = config.model_dump(mode="json")
    return {"kind": kind, "tli": tli, "warm_start": warm, "parameters": sum(p.numel() for p in trainer.drafter.parameters()),
            "steps": trainer.step, "schedule_steps": config.steps, "batch_size": batch, "lr": lr,
            "max_length": max_length, "kl_weight": KL_WEIGHTS[name], "compile": compile_blocks,
            "precision": "bf16" if uses_bf16(config.precision, trainer.device) else "fp32",
            "target_tokens": run_tokens(train, dump, trainer.step), "train_seconds": round(elapsed, 1),
            "sequences": len(train), "heldout_agreement_device": agreement, "metrics": history, "config": dump}
