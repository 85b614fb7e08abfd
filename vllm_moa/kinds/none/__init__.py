"""No drafter: plain decoding through the same loop (runtime), the server's plain generation
(client)."""

from __future__ import annotations

from vllm_moa.registry import DrafterKind, ModelFreeDrafter, register


class NoDrafter(ModelFreeDrafter):
    def __repr__(self) -> str:
        return "NoDrafter()"


NONE = register(DrafterKind(
    name="none",
    summary="no drafter: plain decoding",
    drafter_class=NoDrafter,
    declares_target=False,
))
