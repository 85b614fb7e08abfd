"""The EAGLE-style drafting session in the runtime (decoding/drafters.py's DraftSession)."""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_moa.decoding.drafters import ModelSession
from vllm_moa.decoding.tree import DraftTree
from vllm_moa.kinds.eagle.model import EagleDrafter
from vllm_moa.layers import KVCache, causal_mask_after
from vllm_moa.target import TargetModel, TargetOutput


class EagleSession(ModelSession):
    """One decoder layer's KV cache over (token, previous feature) inputs; past the last verified
    token each node feeds on its parent's predicted feature."""

    def __init__(self, drafter: EagleDrafter, target: TargetModel) -> None:
        self.drafter, self.target, self.device = drafter, target, target.device
        self.cache = KVCache()
        self.last_feature: Tensor | None = None  # target's final hidden at the last verified position

    def _run(self, tokens: Tensor, features_in: Tensor, positions: Tensor | None = None,
             mask: Tensor | None = None) -> Tensor:
        """tokens [1, n], features_in [1, n, E] -> predicted features [1, n, E] (default: a chain
        at the next cache positions)."""
        b, n = tokens.shape
        start = self.cache.length
        if positions is None:
            positions = torch.arange(start, start + n, device=tokens.device).expand(b, n)
        if mask is None:
            mask = causal_mask_after(start, n, tokens.device)
        hidden = self.drafter.fc(torch.cat([self.target.embed(tokens), features_in], dim=-1))
        return self.drafter.layer(hidden, positions, mask, self.cache)

    def _feed_verified(self, tokens: Tensor, true_features: Tensor) -> None:
        """Verified tokens [1, n] with the target's features [1, n, E] at the same positions."""
        previous = torch.cat([self.last_feature, true_features[:, :-1]], dim=1)
        self._run(tokens, previous)
        self.last_feature = true_features[:, -1:]

    def start(self, prompt: Tensor, prefill: TargetOutput) -> None:
        self.last_feature = torch.zeros_like(prefill.hidden_states[-1][:, :1])
        self._feed_verified(prompt, prefill.hidden_states[-1])

    def _begin(self) -> None:
        self.base = self.cache.length
        self.features: list[Tensor] = []  # predicted feature of each fed node, by feed slot

    def _step(self, tokens: Tensor, depths: list[int], parent_slots: list[int], visible: Tensor) -> Tensor:
        n = tokens.shape[0]
        features_in = torch.stack([self.last_feature[0, 0] if s < 0 else self.features[s] for s in parent_slots])
        positions = (self.base + torch.tensor(depths, device=self.device))[None]
        mask = torch.cat([torch.ones(n, self.base, dtype=torch.bool, device=self.device), visible], dim=-1)[None, None]
        out = self._run(tokens[None], features_in[None], positions, mask)[0]  # [n, E]
        self.features.extend(out.unbind(0))
        return self.drafter.draft_logits(out, self.target)

    def accept(self, tree: DraftTree, path: list[int], verified: TargetOutput) -> None:
        self.cache.crop(self.base)
        self._feed_verified(tree.tokens[path][None], verified.hidden_states[-1])
