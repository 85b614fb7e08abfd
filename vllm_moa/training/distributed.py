"""Scale-out on Ray Train: N workers (gloo on CPU, nccl on GPU), each running `Trainer` on its
contiguous share of every global batch. Gradients are summed over workers after each worker
scales its loss by the *global* token count, so N workers take exactly the steps one process
would (tests/integration/test_ray_training.py checks the loss trajectory).

Ray is an optional extra: `pip install vllm-moa[ray]`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_moa.training.data import DraftExample, validate_examples
from vllm_moa.training.trainer import CheckpointError, TrainConfig


def _worker_loop(loop_config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    from vllm_moa.target import TargetModel
    from vllm_moa.training.trainer import Trainer

    context = ray.train.get_context()
    device = ray.train.torch.get_device()
    config = TrainConfig(**{**loop_config["train_config"], "device": str(device)})
    config.progress = config.progress and context.get_world_rank() == 0
    target = TargetModel.from_pretrained(loop_config["target_dir"], device=device)
    train = [DraftExample(tuple(ids), p) for ids, p in loop_config["train"]]
    held = [DraftExample(tuple(ids), p) for ids, p in loop_config["eval"]]
    trainer = Trainer(config, target, train, held, rank=context.get_world_rank(),
                      world_size=context.get_world_size())
    result = trainer.train(resume=loop_config["resume"])
    ray.train.report({"final_loss": result.final_loss, "steps": result.steps})


def train_with_ray(config: TrainConfig, target_dir: str | Path, train: list[DraftExample],
                   held_out: list[DraftExample] = (), num_workers: int = 2, use_gpu: bool = False,
                   resume: bool | str | Path = False) -> dict[str, Any]:
    """Run training on a Ray cluster (started locally if none is running). Returns the run's
    summary.json; the drafter and metrics land in `config.output_dir` as with one process."""
    try:
        import ray
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError as err:
        raise ImportError("Ray training needs the [ray] extra: pip install 'vllm-moa[ray]'") from err
    validate_examples(train, "training data")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if config.batch_size % num_workers:
        raise ValueError(f"batch_size {config.batch_size} must be divisible by the {num_workers} Ray workers")
    if resume:  # refuse a missing checkpoint here, not as a worker's traceback
        checkpoint = Path(config.output_dir) / "checkpoints" / "latest" if resume is True else Path(resume)
        if not checkpoint.exists():
            raise CheckpointError(f"no checkpoint to resume from: {checkpoint} does not exist")
    if not ray.is_initialized():
        ray.init(num_cpus=max(num_workers + 1, 2), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    output_dir = Path(config.output_dir).resolve()
    loop_config = {
        "train_config": {**config.model_dump(mode="json"), "output_dir": str(output_dir)},
        "target_dir": str(Path(target_dir).resolve()),
        "train": [(list(e.input_ids), e.prompt_length) for e in train],
        "eval": [(list(e.input_ids), e.prompt_length) for e in held_out],
        "resume": resume if isinstance(resume, bool) else str(Path(resume).resolve()),
    }
    trainer = TorchTrainer(
        _worker_loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                     resources_per_worker={"GPU": 1} if use_gpu else {"CPU": 1}),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        run_config=RunConfig(name="vllm-moa-train", storage_path=str(output_dir / "ray")),
    )
    try:
        result = trainer.fit()
    except Exception as err:  # Ray wraps a worker's exception; surface the original one
        cause = getattr(err, "__cause__", None)
        raise (cause if isinstance(cause, Exception) else err) from None
    if result.error is not None:
        raise result.error
    # rank 0 wrote the same summary.json a single-process run writes
    return json.loads((output_dir / "summary.json").read_text())
