"""Drafter kinds, one module each, registered once (registry.py; docs/drafter-kinds.md).

The registry's functions are importable from anywhere in the package; the kind modules, which
import the sessions and models they declare, are imported on the first lookup."""

from vllm_moa.kinds.registry import (
    AnyDrafter,
    DrafterArg,
    DrafterKind,
    ModelFreeDrafter,
    all_kinds,
    as_drafter,
    for_config,
    get,
    kind_of,
    load,
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


def __getattr__(name: str):
    if name == "NgramDrafter":
        from vllm_moa.kinds.ngram import NgramDrafter

        return NgramDrafter
    if name == "NoDrafter":
        from vllm_moa.kinds.none import NoDrafter

        return NoDrafter
    raise AttributeError(f"module 'vllm_moa.kinds' has no attribute {name!r}")
