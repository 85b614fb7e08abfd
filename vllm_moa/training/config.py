"""`TrainConfig`: every option of a training run, declared once (name, type, default, meaning).
`Trainer` reads it; `vllm-moa train` derives one flag per field from it (cli.py). Light to import:
pydantic and the drafter-kind registry only."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vllm_moa import registry as kinds


class TrainConfig(BaseModel):
    """Every knob of a training run, declared once: `vllm-moa train` derives one flag per field
    from these declarations (cli.py)."""

    model_config = ConfigDict(extra="forbid")

    drafter: str = Field("moa", description="Drafter kind: moa | eagle (EAGLE-style baseline) | independent (small LM).")
    tli: int = Field(0, ge=0, description="MoA target layer inference: run the target's last N layers on the drafter "
                                          "output.")
    drafter_options: dict[str, Any] = Field(default_factory=dict, description="Drafter config options (config.py).")
    steps: int = Field(300, gt=0, description="Optimizer steps.")
    batch_size: int = Field(8, gt=0, description="Global batch size in sequences (over all workers).")
    max_length: int = Field(512, ge=2, description="Truncate sequences to this many tokens.")
    lr: float = Field(6e-4, gt=0, description="Peak learning rate (AdamW).")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final learning rate as a share of the peak (linear "
                                                             "decay).")
    warmup_steps: int = Field(50, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    kl_weight: float = Field(0.1, ge=0, description="Weight of forward KL(target || drafter).")
    feature_weight: float = Field(1.0, ge=0, description="Weight of the SmoothL1 feature loss.")
    anchor_min: int = Field(6, ge=1, description="Minimum anchor spacing (K-step bound) in the response.")
    anchor_max: int = Field(14, ge=1, description="Maximum anchor spacing (drawn uniformly per sample).")
    short_repeats: int = Field(1, ge=1, description="An epoch draws each training sequence of at most short_length "
                                                    "tokens this many times (longer ones once): weights short "
                                                    "answers up when long ones join the data.")
    short_length: int = Field(320, ge=1, description="Longest sequence (tokens, after max_length) that short_repeats "
                                                     "counts as short.")
    staircase: bool = Field(True, description="Staircase SA mask curriculum early in training.")
    staircase_until: float = Field(0.5, ge=0, le=1, description="Share of training at which the staircase "
                                                                "probability reaches 0.")
    eagle_rollout: int = Field(1, ge=1, description="EAGLE feature-autoregression passes in training (1 = teacher "
                                                    "forcing).")
    eval_depth: int = Field(6, ge=1, description="Report agreement with the target at draft depths 0..this (0 = the "
                                                 "anchor itself).")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto (bf16 autocast on CUDA when "
                                                                           "supported, and on CPUs that compute "
                                                                           "bf16 natively: avx512_bf16 / AMX) | "
                                                                           "fp32 | bf16.")
    compile: bool = Field(False, description="torch.compile the drafter's blocks (dynamic shapes; a warm-up of "
                                            "about a minute, then faster steps: fused norms, RoPE and SwiGLU).")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N.")
    seed: int = Field(0, description="Seed of initialisation, data order, anchors and staircase.")
    log_every: int = Field(10, gt=0, description="Write a metrics.jsonl line every N steps.")
    checkpoint_every: int = Field(100, gt=0, description="Checkpoint every N steps (and at the end).")
    checkpoint_minutes: float | None = Field(None, gt=0, description="Also checkpoint when this many minutes "
                                             "passed since the last checkpoint (single-process runs).")
    keep_checkpoints: int = Field(2, ge=1, description="How many recent checkpoints to keep.")
    output_dir: str = Field("runs/drafter", description="Run directory: checkpoints/, metrics.jsonl, drafter/.")
    progress: bool = Field(True, description="Show progress bars.")

    @field_validator("drafter")
    @classmethod
    def _trainable_kind(cls, name: str) -> str:
        trainable = kinds.names(lambda kind: kind.trainable)
        if name not in trainable:
            raise ValueError(f"{name!r} is not a trainable drafter kind; trainable: {', '.join(trainable)}")
        return name

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.anchor_min > self.anchor_max:
            raise ValueError(f"anchor_min ({self.anchor_min}) must be <= anchor_max ({self.anchor_max})")
        if self.tli and "tli" not in kinds.get(self.drafter).config_class.OPTIONS:
            with_tli = kinds.names(lambda kind: kind.trainable and "tli" in kind.config_class.OPTIONS)
            raise ValueError(f"tli applies to drafters whose config declares it ({', '.join(with_tli)}), "
                             f"not {self.drafter}")
        return self
