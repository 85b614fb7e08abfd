"""What every drafter shares: a config with the target's signature, safetensors save/load of the
trainable weights only, and the training-mode interface the trainer calls."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from vllm_moa.config import WEIGHTS_NAME, DrafterConfigBase, DrafterConfigError

if TYPE_CHECKING:
    from vllm_moa.target import TargetModel, TargetOutput


@dataclass
class TrainingBatchView:
    """What a drafter's training forward needs (see training/masks.py).

    input_ids:   [B, T]
    last_anchor: [B, T] s(i)
    staircase:   [B] bool, use the staircase SA mask for this sample
    """

    input_ids: Tensor
    last_anchor: Tensor
    staircase: Tensor


@dataclass
class DraftOutput:
    """Training-mode output. logits [B, T, V] predict token i+1 at position i.

    features: pairs (prediction, target) [B, T, E] for the SmoothL1 loss, with weights summing to 1.
    """

    logits: Tensor
    features: list[tuple[Tensor, Tensor, float]]


class Drafter(nn.Module):
    """Base class: holds only trainable weights; the target is passed in at call time."""

    config_class: ClassVar[type[DrafterConfigBase]]

    def __init__(self, config: DrafterConfigBase) -> None:
        super().__init__()
        self.config = config

    def training_forward(self, batch: TrainingBatchView, target: "TargetModel",
                         target_out: "TargetOutput") -> DraftOutput:
        raise NotImplementedError

    # -- checkpoint format --------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path) -> None:
        """config.json + model.safetensors (trainable weights only), written atomically."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        self.config.save_pretrained(tmp)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        replace_directory(tmp, directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path, target: "TargetModel | None" = None,
                        strict_fingerprint: bool = True) -> "Drafter":
        """Load a drafter; with `target`, refuse it unless it was trained for that target."""
        config = cls.config_class.read(directory)
        if target is not None:
            config.target_signature.check_compatible(target.signature, strict_fingerprint=strict_fingerprint)
        model = cls(config)
        path = Path(directory) / WEIGHTS_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no {WEIGHTS_NAME} in drafter directory {directory}")
        try:
            state = load_file(str(path))
        except Exception as err:  # safetensors raises its own error type for corrupt files
            raise DrafterConfigError(f"{path}: unreadable weights ({err})") from None
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise DrafterConfigError(
                f"{path}: weights do not match config.json (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        if target is not None:
            model.to(device=target.device, dtype=target.dtype)
        return model


def replace_directory(new: Path, final: Path) -> None:
    """Atomically put directory `new` at `final`: a reader sees the old or the new, never half."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(new, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, final)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def load_drafter(directory: str | Path, target: "TargetModel | None" = None,
                 strict_fingerprint: bool = True) -> Drafter:
    """Load any drafter checkpoint, dispatching on config.json's model_type."""
    from vllm_moa.config import read_drafter_config
    from vllm_moa.models import DRAFTER_CLASSES

    config = read_drafter_config(directory)
    return DRAFTER_CLASSES[config.model_type].from_pretrained(directory, target, strict_fingerprint)

