"""The independent small LM's client-side session (serving/local.py): needs nothing from the server."""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_moa.decoding.tree import DraftTree
from vllm_moa.kinds.independent.model import IndependentDrafter
from vllm_moa.kinds.independent.session import IndependentSession
from vllm_moa.serving.local import LocalDrafting, SyncTensors
from vllm_moa.serving.protocol import DrafterDecl


class LocalIndependent(IndependentSession, LocalDrafting):
    kind = "independent"

    def __init__(self, drafter: IndependentDrafter) -> None:
        super().__init__(drafter)
        self._init_local()

    def declaration(self) -> DrafterDecl:
        return DrafterDecl(kind="independent", target=self.drafter.config.target_signature.to_dict())

    def start(self, prompt: list[int], sync: SyncTensors) -> None:
        self.drafter(torch.tensor([prompt], device=self.device), self.caches)
        self.verified = self.caches[0].length

    def accept(self, tree: DraftTree, path: list[int], sync: SyncTensors) -> None:
        super().accept(tree, path, None)  # needs nothing from the target
        self.verified = self.caches[0].length
        self.fed = []

    def rollback(self) -> None:
        for cache in self.caches:
            cache.crop(self.verified)
        self.fed = []

    def _chain_logits(self, tokens: list[int]) -> Tensor:
        return self.drafter(torch.tensor([tokens], device=self.device), self.caches)[0, -1]
