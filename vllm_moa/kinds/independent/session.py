"""The independent small LM's drafting session in the runtime (decoding/drafters.py's DraftSession)."""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_moa.decoding.drafters import ModelSession, fed_prefix, keep_index
from vllm_moa.decoding.tree import DraftTree
from vllm_moa.kinds.independent.model import IndependentDrafter
from vllm_moa.layers import KVCache
from vllm_moa.target import TargetOutput


class IndependentSession(ModelSession):
    """A small LM with its own KV caches, compacted to the accepted path."""

    def __init__(self, drafter: IndependentDrafter) -> None:
        self.drafter = drafter
        self.device = next(drafter.parameters()).device
        self.caches = [KVCache() for _ in drafter.layers]

    def start(self, prompt: Tensor, prefill: TargetOutput) -> None:
        self.drafter(prompt, self.caches)

    def _begin(self) -> None:
        self.base = self.caches[0].length

    def _step(self, tokens: Tensor, depths: list[int], parent_slots: list[int], visible: Tensor) -> Tensor:
        n = tokens.shape[0]
        positions = (self.base + torch.tensor(depths, device=self.device))[None]
        mask = torch.cat([torch.ones(n, self.base, dtype=torch.bool, device=self.device), visible], dim=-1)[None, None]
        return self.drafter(tokens[None], self.caches, positions, mask)[0]

    def accept(self, tree: DraftTree, path: list[int], verified: TargetOutput) -> None:
        fed = fed_prefix(tree, path)
        keep = keep_index(self.base, fed, self.device)
        for cache in self.caches:
            cache.select(keep)
        if len(fed) < len(path):
            self.drafter(tree.tokens[path[len(fed):]][None], self.caches)
