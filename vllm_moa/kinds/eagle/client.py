"""The EAGLE-style client-side session (serving/local.py): fed by the server's final hidden states."""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_moa.decoding.tree import DraftTree
from vllm_moa.kinds.eagle.model import EagleDrafter
from vllm_moa.kinds.eagle.session import EagleSession
from vllm_moa.serving.local import LocalDrafting, SyncTensors
from vllm_moa.serving.payload import PayloadError
from vllm_moa.serving.protocol import DrafterDecl
from vllm_moa.target import TargetModel


class LocalEagle(EagleSession, LocalDrafting):
    kind = "eagle"

    def __init__(self, drafter: EagleDrafter, target: TargetModel) -> None:
        super().__init__(drafter, target)
        self._init_local()
        self._predicted: Tensor | None = None  # feature predicted at the last fed chain token

    def declaration(self) -> DrafterDecl:
        return DrafterDecl(kind="eagle", target=self.drafter.config.target_signature.to_dict())

    def _hidden(self, sync: SyncTensors) -> Tensor:
        if sync.hidden is None:
            raise PayloadError("the server sent no hidden states for verified tokens")
        return sync.hidden

    def start(self, prompt: list[int], sync: SyncTensors) -> None:
        hidden = self._hidden(sync)
        self.last_feature = torch.zeros_like(hidden[:, :1])
        self._feed_verified(torch.tensor([prompt], device=self.device), hidden)
        self.verified = self.cache.length

    def accept(self, tree: DraftTree, path: list[int], sync: SyncTensors) -> None:
        self.cache.crop(self.base)
        self._feed_verified(tree.tokens[path][None].to(self.device), self._hidden(sync))
        self.verified = self.cache.length
        self.fed = []

    def rollback(self) -> None:
        self.cache.crop(self.verified)
        self.fed = []

    def _chain_logits(self, tokens: list[int]) -> Tensor:
        for token in tokens:  # feature-autoregressive: one token at a time
            feature_in = self.last_feature if self.cache.length == self.verified else self._predicted
            self._predicted = self._run(torch.tensor([[token]], device=self.device), feature_in)  # [1, 1, E]
        return self.drafter.draft_logits(self._predicted, self.target)[0, -1]
