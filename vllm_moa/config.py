"""Drafter configurations and the signature of the target a drafter was trained for.

Every drafter checkpoint is a directory with `config.json` (one of the configs below, a
transformers `PretrainedConfig` with its own `model_type`) and `model.safetensors` holding only
the drafter's trainable weights. The config records the target's `TargetSignature`, so that a
drafter is refused, with both values named, when it is loaded against another target.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from pydantic import TypeAdapter, ValidationError
from transformers import PretrainedConfig

from vllm_moa import registry

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# the keys vllm-project/speculators writes beside a drafter's own config (speculators_format.py
# writes and checks them); a drafter's config accepts them and keeps them out of its options
SPECULATORS_KEYS = ("speculators_model_type", "speculators_config", "transformer_layer_config", "speculators_version")


class DrafterTargetMismatch(ValueError):
    """A drafter was loaded against a target it was not trained for."""


class DrafterConfigError(ValueError):
    """A drafter config.json is malformed (unknown key, wrong type, impossible value)."""


@dataclass(frozen=True)
class TargetSignature:
    """What a drafter depends on in its target. Shapes must match exactly; `fingerprint` is a
    hash of a strided sample of the target's embedding and LM head (bf16-rounded, so it does not
    depend on the dtype the target was loaded in)."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    name: str = ""
    fingerprint: str = ""

    # Fields that must agree for the drafter's tensors to make sense at all.
    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = (
        "architecture",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_kv_heads",
        "head_dim",
        "vocab_size",
    )

    @property
    def kv_width(self) -> int:
        """Ekv = H_kv * d: the width of one layer's K (or V) for one token."""
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetSignature:
        if not isinstance(data, dict):
            raise DrafterConfigError(f"config key 'target' must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DrafterConfigError(f"unknown key(s) in config 'target': {', '.join(unknown)}")
        missing = [name for name in cls.SHAPE_FIELDS if name not in data]
        if missing:
            raise DrafterConfigError(f"config 'target' is missing key(s): {', '.join(missing)}")
        for f in fields(cls):
            if f.name in data:
                want = str if f.name in ("architecture", "name", "fingerprint") else int
                if type(data[f.name]) is not want:
                    raise DrafterConfigError(
                        f"config 'target' key {f.name!r} must be {want.__name__}, got {data[f.name]!r}"
                    )
        return cls(**data)

    def check_compatible(self, actual: TargetSignature, *, strict_fingerprint: bool = True) -> None:
        """Raise `DrafterTargetMismatch` naming the first field where `actual` differs."""
        for name in self.SHAPE_FIELDS:
            want, got = getattr(self, name), getattr(actual, name)
            if want != got:
                raise DrafterTargetMismatch(
                    f"drafter was trained for a target with {name}={want!r} "
                    f"(target {self.name or '?'}), but the given target has {name}={got!r} "
                    f"(target {actual.name or '?'})"
                )
        if strict_fingerprint and self.fingerprint and actual.fingerprint and self.fingerprint != actual.fingerprint:
            raise DrafterTargetMismatch(
                f"drafter was trained for target weights with fingerprint={self.fingerprint} "
                f"(target {self.name or '?'}), but the given target has fingerprint={actual.fingerprint} "
                f"(target {actual.name or '?'}): same shapes, different weights"
            )


@dataclass(frozen=True)
class Option:
    """One drafter option, declared once: its type, default and meaning. The config's attributes,
    constructor defaults, config.json validation and `vllm-moa train --drafter-config` keys all
    come from these declarations. A float option also takes an int (10000 is a fine rope_theta);
    every other type is checked strictly."""

    type: type
    default: Any
    help: str
    required: bool = True  # in config.json (False: older checkpoints lack it; the default applies)

    def validate(self, key: str, value: Any, source: str) -> None:
        try:
            TypeAdapter(self.type).validate_python(value, strict=self.type is not float)
        except ValidationError as err:
            raise DrafterConfigError(f"{source}: key {key!r} has invalid value {value!r}: "
                                     f"{err.errors()[0]['msg']}") from None


def decoder_options(heads: int, kv_heads: int, head_dim: int, intermediate: int) -> dict[str, Option]:
    """The options of one Llama-style decoder block (EAGLE-style and independent drafters)."""
    return {
        "num_heads": Option(int, heads, "attention heads"),
        "num_kv_heads": Option(int, kv_heads, "key/value heads (GQA; divides num_heads)"),
        "head_dim": Option(int, head_dim, "size of one head (even: rotary embedding)"),
        "intermediate_size": Option(int, intermediate, "SwiGLU hidden size"),
        "rope_theta": Option(float, 10000.0, "rotary embedding base"),
        "rms_norm_eps": Option(float, 1e-6, "RMSNorm epsilon"),
    }


class DrafterConfigBase(PretrainedConfig):
    """Shared behaviour: a target signature, the options each subclass declares in OPTIONS (set as
    attributes, with their defaults), strict validation of config.json keys."""

    model_type = "moa_drafter_base"
    # every drafter kind has these; draft_vocab_size 0 = the target's whole vocabulary, N > 0 = a
    # reduced draft vocabulary of N target token ids (EAGLE-3), stored as the `draft_vocab` tensor
    # in model.safetensors
    BASE_OPTIONS: ClassVar[dict[str, Option]] = {
        "draft_vocab_size": Option(int, 0, "reduced draft vocabulary size (0 = the target's)", required=False),
    }
    OPTIONS: ClassVar[dict[str, Option]] = {}
    SUPPORTS_DRAFT_VOCAB: ClassVar[bool] = True
    # the speculators algorithm (= vLLM speculative method) that serves this kind by its directory
    # alone (speculators_format.py); None: vLLM does not serve it
    SPECULATORS_ALGORITHM: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # transformers >= 5 turns a config subclass without an __init__ of its own into a dataclass
        # with a generated one; every drafter config keeps this generic, OPTIONS-driven __init__
        if "__init__" not in cls.__dict__:
            cls.__init__ = DrafterConfigBase.__init__
        super().__init_subclass__(**kwargs)

    def __init__(self, target: dict[str, Any] | TargetSignature | None = None, **kwargs: Any) -> None:
        if isinstance(target, TargetSignature):
            target = target.to_dict()
        self.target = target
        for key, option in self.option_fields().items():
            value = kwargs.pop(key, option.default)
            setattr(self, key, float(value) if option.type is float else value)
        super().__init__(**kwargs)

    @classmethod
    def option_fields(cls) -> dict[str, Option]:
        """Every option of this drafter kind (what a training run's drafter_options may set)."""
        return {**cls.OPTIONS, **cls.BASE_OPTIONS}

    @classmethod
    def check_option(cls, key: str, value: Any, source: str = "config") -> None:
        """A DrafterConfigError naming the key unless `key` is an option and `value` fits its type."""
        options = cls.option_fields()
        if key not in options:
            raise DrafterConfigError(f"{source}: unknown key {key!r} for {cls.__name__}; known: "
                                     f"{', '.join(sorted(options))}")
        options[key].validate(key, value, source)

    def check_draft_vocab(self, source: str = "config") -> None:
        size, vocab = self.draft_vocab_size, self.target_signature.vocab_size
        if size and not self.SUPPORTS_DRAFT_VOCAB:
            raise DrafterConfigError(f"{source}: key 'draft_vocab_size' is not supported by {type(self).__name__}")
        if not 0 <= size <= vocab:
            raise DrafterConfigError(f"{source}: key 'draft_vocab_size' must be in 0..{vocab} (target vocabulary), "
                                     f"got {size}")

    @property
    def target_signature(self) -> TargetSignature:
        if self.target is None:
            raise DrafterConfigError("config has no 'target' signature")
        return TargetSignature.from_dict(self.target)

    # -- validation ---------------------------------------------------------------------------
    @classmethod
    def validated_from_dict(cls, data: dict[str, Any], source: str = "config") -> DrafterConfigBase:
        """Build a config from a JSON object, naming the offending key on any problem."""
        if not isinstance(data, dict):
            raise DrafterConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        model_type = data.get("model_type")
        if model_type != cls.model_type:
            raise DrafterConfigError(
                f"{source}: key 'model_type' is {model_type!r}, expected {cls.model_type!r}"
            )
        base_keys = set(PretrainedConfig().to_dict()) | {"model_type", "target", *SPECULATORS_KEYS}
        for key, value in data.items():
            if key not in base_keys:
                cls.check_option(key, value, source)
        missing = [key for key, option in cls.option_fields().items() if option.required and key not in data]
        if missing:
            raise DrafterConfigError(f"{source}: missing key(s) {', '.join(missing)}")
        if "target" not in data:
            raise DrafterConfigError(f"{source}: missing key 'target'")
        TargetSignature.from_dict(data["target"])
        kwargs = {k: v for k, v in data.items() if k != "model_type" and k not in SPECULATORS_KEYS}
        config = cls(**kwargs)
        config.check_values(source)
        config.check_draft_vocab(source)
        return config

    def check_values(self, source: str = "config") -> None:
        """Per-config semantic checks (divisibility, ranges); override."""

    @classmethod
    def read(cls, directory: str | Path) -> DrafterConfigBase:
        path, data = read_config_json(directory)
        return cls.validated_from_dict(data, source=str(path))


def read_config_json(directory: str | Path) -> tuple[Path, Any]:
    """(path, parsed JSON) of a drafter directory's config.json, with clear errors."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in drafter directory {directory}")
    try:
        return path, json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DrafterConfigError(f"{path}: not valid JSON ({err})") from None


def check_positive(config: PretrainedConfig, source: str, *keys: str) -> None:
    for key in keys:
        value = getattr(config, key)
        if value <= 0:
            raise DrafterConfigError(f"{source}: key {key!r} must be > 0, got {value}")


def check_divisible(config: PretrainedConfig, source: str, heads_key: str, kv_heads_key: str) -> None:
    heads, kv_heads = getattr(config, heads_key), getattr(config, kv_heads_key)
    if heads % kv_heads:
        raise DrafterConfigError(
            f"{source}: key {heads_key!r}={heads} must be a multiple of {kv_heads_key!r}={kv_heads}"
        )


def read_drafter_config(directory: str | Path) -> DrafterConfigBase:
    """Read and validate any drafter's config.json, dispatching on its `model_type`."""
    path, data = read_config_json(directory)
    model_type = data.get("model_type") if isinstance(data, dict) else None
    kind = registry.for_config(model_type)
    if kind is None:
        known = sorted(k.config_class.model_type for k in registry.all_kinds() if k.trainable)
        raise DrafterConfigError(f"{path}: key 'model_type' is {model_type!r}; expected one of {known}")
    return kind.config_class.validated_from_dict(data, source=str(path))
