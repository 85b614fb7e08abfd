"""n-gram lookup's client-side session (serving/local.py): needs nothing from the server."""

from __future__ import annotations

import torch

from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.decoding.tree import DraftTree
from vllm_moa.kinds.ngram.session import NgramSession
from vllm_moa.serving.local import LocalDrafting, SyncTensors
from vllm_moa.serving.protocol import DrafterDecl


class LocalNgram(NgramSession, LocalDrafting):
    kind = "ngram"
    device = torch.device("cpu")

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        super().__init__(max_ngram, min_ngram)
        self._init_local()

    def declaration(self) -> DrafterDecl:
        return DrafterDecl(kind="ngram")

    def start(self, prompt: list[int], sync: SyncTensors) -> None:
        self.history = list(prompt)

    def accept(self, tree: DraftTree, path: list[int], sync: SyncTensors) -> None:
        super().accept(tree, path, None)

    def _begin(self) -> None:
        pass

    def rollback(self) -> None:
        self.fed = []

    def draft_ahead(self, chain: list[int], n: int, sampling: SamplingParams | None = None,
                    generator: torch.Generator | None = None, stop_token: int | None = None) -> list[int]:
        """What followed the latest match of the chain's suffix (nothing when there is none)."""
        history = self.history
        self.history = history + chain[:-1]
        try:
            found = self.continuations(chain[-1], n, 1)
        finally:
            self.history = history
        out = found[0] if found else []
        if stop_token is not None and stop_token in out:
            out = out[: out.index(stop_token) + 1]
        return out
