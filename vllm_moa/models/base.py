"""What every drafter shares: a config with the target's signature, safetensors save/load of the
trainable weights only, and the training-mode interface the trainer calls."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from vllm_moa import registry
from vllm_moa.config import WEIGHTS_NAME, DrafterConfigBase, DrafterConfigError, read_drafter_config
from vllm_moa.packed_linear import check_drafter_weights, frozen_linear, linear, weight_format
from vllm_moa.shipped import drafter_directory

if TYPE_CHECKING:
    from vllm_moa.target import TargetModel, TargetOutput


@dataclass
class TrainingBatchView:
    """What a drafter's training forward needs (see models/masks.py).

    input_ids:   [B, T]
    last_anchor: [B, T] s(i)
    staircase:   [B] bool, use the staircase SA mask for this sample
    lengths:     [B] real tokens per row (the rest is padding no real position reads), or None
    """

    input_ids: Tensor
    last_anchor: Tensor
    staircase: Tensor
    lengths: Tensor | None = None

    def real_tokens(self) -> Tensor | None:
        """[B * T] flat indices of the real (unpadded) tokens, or None when every token is real."""
        if self.lengths is None:
            return None
        b, t = self.input_ids.shape
        real = torch.arange(t, device=self.input_ids.device)[None, :] < self.lengths.to(self.input_ids.device)[:, None]
        return None if bool(real.all()) else real.flatten().nonzero().squeeze(1)


@dataclass
class DraftOutput:
    """Training-mode output. logits [B, T, V] predict token i+1 at position i.

    features: pairs (prediction, target) [B, T, E] for the SmoothL1 loss, with weights summing to 1.
    vocab:    [N] with a reduced draft vocabulary: logits are then [B, T, N] over these target ids
    """

    logits: Tensor
    features: list[tuple[Tensor, Tensor, float]]
    vocab: Tensor | None = None

    def tokens(self) -> Tensor:
        """[B, T] the drafter's argmax next token, as a target token id."""
        best = self.logits.argmax(-1)
        return best if self.vocab is None else self.vocab[best]


class Drafter(nn.Module):
    """Base class: holds only trainable weights; the target is passed in at call time."""

    config_class: ClassVar[type[DrafterConfigBase]]

    def __init__(self, config: DrafterConfigBase) -> None:
        super().__init__()
        self.config = config
        size = getattr(config, "draft_vocab_size", 0)
        # [N] target token ids the drafter may propose (sorted; training sets them, the checkpoint stores them)
        self.draft_vocab: Tensor | None
        if size:
            self.register_buffer("draft_vocab", torch.arange(size, dtype=torch.long))
        else:
            self.draft_vocab = None
        self._head_rows: tuple[tuple, nn.Linear] | None = None  # cache of the target LM head's vocab rows

    def init_from_target(self, target: TargetModel) -> None:
        """Initialise what a fresh drafter takes from its target before training (default: nothing)."""

    def set_draft_vocab(self, token_ids: Tensor) -> None:
        """Fix the reduced draft vocabulary: [N] distinct target token ids."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().sort().values
        if self.draft_vocab is None or ids.shape != self.draft_vocab.shape:
            raise ValueError(f"draft vocabulary needs {getattr(self.config, 'draft_vocab_size', 0)} ids "
                             f"(draft_vocab_size), got {ids.numel()}")
        if ids.unique().numel() != ids.numel() or ids[0] < 0 or ids[-1] >= self.config.target_signature.vocab_size:
            raise ValueError("draft vocabulary ids must be distinct target token ids")
        self.draft_vocab.copy_(ids.to(self.draft_vocab.device))
        self._head_rows = None

    def _vocab_head(self, target: TargetModel) -> nn.Linear:
        """The target LM head's rows of the draft vocabulary as a frozen [E -> N] linear layer
        (cached while the head and the vocabulary are unchanged)."""
        weight = target.lm_head_weight()
        key = (weight.data_ptr(), weight.dtype, weight.device, self.draft_vocab.data_ptr(), self.draft_vocab._version,
               getattr(self, "_weight_format", "fp32"))
        if self._head_rows is None or self._head_rows[0] != key:
            rows = weight.detach().index_select(0, self.draft_vocab)  # [N, E]
            self._head_rows = (key, frozen_linear(rows, getattr(self, "_weight_format", "fp32")))
        return self._head_rows[1]

    def vocab_logits(self, feature: Tensor, target: TargetModel) -> Tensor:
        """feature [..., E] -> logits [..., N] over the draft vocabulary ([..., V]: the whole one)."""
        if self.draft_vocab is None:
            return target.lm_head(feature)
        return linear(feature, self._vocab_head(target))

    def draft_logits(self, feature: Tensor, target: TargetModel) -> Tensor:
        """feature [..., E] -> logits [..., V] over the target's vocabulary; tokens outside the
        draft vocabulary get -inf (never drafted; verification stays full-vocabulary)."""
        logits = self.vocab_logits(feature, target)
        if self.draft_vocab is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.target_signature.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab, logits)

    def training_forward(self, batch: TrainingBatchView, target: TargetModel,
                         target_out: TargetOutput) -> DraftOutput:
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
    def from_pretrained(cls, directory: str | Path, target: TargetModel | None = None,
                        strict_fingerprint: bool = True) -> Drafter:
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


def load_drafter(directory: str | Path, target: TargetModel | None = None,
                 strict_fingerprint: bool = True) -> Drafter:
    """Load any drafter checkpoint, dispatching on config.json's model_type."""
    config = read_drafter_config(directory)
    return registry.for_config(config.model_type).drafter_class.from_pretrained(directory, target, strict_fingerprint)


def load_named(drafter: str | Path | None, target: TargetModel | None,
               weights: str = "fp32") -> registry.AnyDrafter:
    """What a user names on the command line or in the API: a model-free kind's name, None, a
    shipped drafter's name or a drafter directory (loaded against `target`, in eval mode, its
    linears on `weights` in CPU inference: packed_linear.DRAFTER_WEIGHTS)."""
    check_drafter_weights(weights)  # refused before anything loads
    if drafter is None or (isinstance(drafter, str) and drafter in registry.names(lambda kind: kind.model_free)):
        return registry.as_drafter(drafter)
    return weight_format(load_drafter(drafter_directory(drafter), target).eval(), weights)

