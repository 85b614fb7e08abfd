"""MoA's drafting session in the runtime (decoding/drafters.py's DraftSession): CA rows of
verified tokens + the SA KV cache (+ TLI caches), compacted to the accepted path."""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_moa.decoding.drafters import ModelSession, fed_prefix, keep_index
from vllm_moa.decoding.tree import DraftTree
from vllm_moa.kinds.moa.model import MoADrafter
from vllm_moa.target import TargetModel, TargetOutput


class MoASession(ModelSession):
    """CA rows of verified tokens + SA KV cache (+ TLI caches), compacted to the accepted path."""

    def __init__(self, drafter: MoADrafter, target: TargetModel) -> None:
        self.drafter, self.target, self.device = drafter, target, target.device
        self.state = drafter.new_state()

    def start(self, prompt: Tensor, prefill: TargetOutput) -> None:
        self.drafter.extend_verified(self.state, prefill.keys, prefill.values, prefill.hidden_states[-1])
        self.drafter.feed(self.state, prompt, self.target)

    def _begin(self) -> None:
        self.base = self.state.num_verified  # the root's position; SA holds exactly the verified tokens

    def _step(self, tokens: Tensor, depths: list[int], parent_slots: list[int], visible: Tensor) -> Tensor:
        positions = (self.base + torch.tensor(depths, device=self.device))[None]  # [1, n]
        return self.drafter.draft_step(self.state, tokens[None], self.target, positions, visible)[0]

    def accept(self, tree: DraftTree, path: list[int], verified: TargetOutput) -> None:
        first = len(verified.keys) - self.drafter.tli
        self.accept_rows(tree, path, self.drafter.rows_from_kv(verified.keys, verified.values,
                                                                verified.hidden_states[-1]),
                         verified.keys[first:], verified.values[first:])

    def accept_rows(self, tree: DraftTree, path: list[int], rows: Tensor, tli_keys: list[Tensor],
                    tli_values: list[Tensor]) -> None:
        """`accept` from what a server sends instead of the target's output: the accepted nodes'
        Ekv2E rows [1, n, E] (+ last-TLI-layer K/V), as in serving/."""
        fed = fed_prefix(tree, path)
        self.state.sa.select(keep_index(self.base, fed, self.device))
        self.drafter.extend_rows(self.state, rows, tli_keys, tli_values)  # also drops TLI drafts
        if len(fed) < len(path):  # accepted nodes never run through SA (the last level's leaves)
            self.drafter.feed(self.state, tree.tokens[path[len(fed):]][None].to(self.device), self.target)
