"""n-gram lookup (prompt lookup): proposes what followed earlier matches of the recent suffix. No
weights: `NgramDrafter` carries its options only.

    session.py   NgramSession: drafting in the runtime
    client.py    LocalNgram: drafting on a client (nothing to sync)

and the one registration below."""

from __future__ import annotations

from vllm_moa.kinds.ngram.client import LocalNgram
from vllm_moa.kinds.ngram.session import NgramSession
from vllm_moa.registry import DrafterKind, ModelFreeDrafter, register


class NgramDrafter(ModelFreeDrafter):
    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def __repr__(self) -> str:
        return f"NgramDrafter(max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"


NGRAM = register(DrafterKind(
    name="ngram",
    summary="n-gram lookup over the sequence so far",
    drafter_class=NgramDrafter,
    runtime_session=lambda drafter, target: NgramSession(drafter.max_ngram, drafter.min_ngram),
    client_session=lambda drafter, target: LocalNgram(drafter.max_ngram, drafter.min_ngram),
    declares_target=False,
))

__all__ = ["NGRAM", "LocalNgram", "NgramDrafter", "NgramSession"]
