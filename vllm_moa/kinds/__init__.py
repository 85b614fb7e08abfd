"""Drafter kinds, one module each, the layer that composes models, decoding and serving into a
kind (docs/drafter-kinds.md). Each module registers its kind with vllm_moa/registry.py, which
finds them through pyproject.toml's entry point group `vllm_moa.drafter_kinds`; nothing below this
layer imports it. Importing this package registers every built-in kind and re-exports the
registry's functions."""

# isort: off
# each module registers its kind; this order is the registry's (what users see listed)
from vllm_moa.kinds import moa  # noqa: F401
from vllm_moa.kinds import eagle  # noqa: F401
from vllm_moa.kinds import independent  # noqa: F401
from vllm_moa.kinds import ngram  # noqa: F401
from vllm_moa.kinds import none  # noqa: F401
# isort: on
from vllm_moa.kinds.ngram import NgramDrafter
from vllm_moa.kinds.none import NoDrafter
from vllm_moa.models import load_named as load
from vllm_moa.registry import (
    AnyDrafter,
    DrafterArg,
    DrafterKind,
    ModelFreeDrafter,
    all_kinds,
    as_drafter,
    for_config,
    get,
    kind_of,
    names,
    open_runtime_session,
    register,
)

__all__ = [
    "AnyDrafter",
    "DrafterArg",
    "DrafterKind",
    "ModelFreeDrafter",
    "NgramDrafter",
    "NoDrafter",
    "all_kinds",
    "as_drafter",
    "for_config",
    "get",
    "kind_of",
    "load",
    "names",
    "open_runtime_session",
    "register",
]
