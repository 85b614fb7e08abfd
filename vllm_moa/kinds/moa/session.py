"""MoA's drafting session in the runtime (decoding/drafters.py's DraftSession): CA rows of
verified tokens + the SA KV cache (+ TLI caches), compacted to the accepted path. Sessions of one
TLI = 0 drafter draft and accept a batch's sequences together (batched.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from vllm_moa.decoding.drafters import ModelSession, fed_prefix, keep_index
from vllm_moa.decoding.tree import DraftTree
from vllm_moa.kinds.moa import batched
from vllm_moa.kinds.moa.model import MoADrafter
from vllm_moa.target import TargetModel, TargetOutput


class MoASession(ModelSession):
    """CA rows of verified tokens + SA KV cache (+ TLI caches), compacted to the accepted path."""

    def __init__(self, drafter: MoADrafter, target: TargetModel) -> None:
        self.drafter, self.target, self.device = drafter, target, target.device
        self.state = drafter.new_state()

    @property
    def starts_from_suffix(self) -> bool:
        """TLI = 0 only: SA and CA use relative positions, so a suffix is a shorter context (the
        target's last layers, run at TLI > 0, need absolute positions)."""
        return self.drafter.tli == 0

    def start(self, prompt: Tensor, prefill: TargetOutput) -> None:
        covered = prefill.keys[0].shape[2]  # the prompt's last `covered` tokens (all, usually)
        if covered < prompt.shape[1]:
            if not self.starts_from_suffix:
                raise ValueError(f"a TLI={self.drafter.tli} MoA session starts from the whole prompt "
                                 f"({prompt.shape[1]} tokens), got the target's outputs over {covered}")
            prompt = prompt[:, -covered:]
        self.drafter.extend_verified(self.state, prefill.keys, prefill.values, prefill.hidden_states[-1])
        self.drafter.feed(self.state, prompt, self.target)

    def _begin(self) -> None:
        self.base = self.state.num_verified  # the root's position; SA holds exactly the verified tokens

    def _step(self, tokens: Tensor, depths: list[int], parent_slots: list[int], visible: Tensor) -> Tensor:
        positions = (self.base + torch.tensor(depths, device=self.device))[None]  # [1, n]
        return self.drafter.draft_step(self.state, tokens[None], self.target, positions, visible)[0]

    # -- a batch's sequences together (decoding/drafters.propose_all / accept_all) ---------------
    def batch_key(self) -> object | None:
        return (id(self.drafter), id(self.target)) if self.drafter.tli == 0 else None

    @classmethod
    def _open_batch(cls, sessions: Sequence[MoASession]) -> batched.BatchedRound:
        return batched.open_round([s.state for s in sessions])

    @classmethod
    def _step_batch(cls, batch: batched.BatchedRound, sessions: Sequence[MoASession],
                    levels: list) -> list[Tensor | None]:
        inputs = [None if level is None else
                  (level[0], s.base + torch.tensor(level[1], device=s.device), level[3])
                  for s, level in zip(sessions, levels)]
        return batched.step(sessions[0].drafter, batch, sessions[0].target, inputs)

    @classmethod
    def _close_batch(cls, batch: batched.BatchedRound, sessions: Sequence[MoASession]) -> None:
        batched.close_round(batch)

    @classmethod
    def accept_batch(cls, sessions: Sequence[MoASession], trees: Sequence[DraftTree], paths: Sequence[list[int]],
                     verified: Sequence[TargetOutput]) -> None:
        """accept() for many sequences: one LSA call, one CA key/value call and one SA feed of the
        accepted nodes never fed, for all of them (TLI = 0: batch_key)."""
        drafter = sessions[0].drafter
        rows = batched.rows_for_many(drafter, list(verified))
        row_kv = batched.row_kv_for_many(drafter, [s.state for s in sessions], rows)
        unfed = [(s.state, tokens) for s, tree, path, r, kv in zip(sessions, trees, paths, rows, row_kv)
                 if (tokens := s._keep(tree, path, r, [], [], kv)) is not None]  # every session kept; some to feed
        if unfed:
            batched.feed_many(drafter, [state for state, _ in unfed], [tokens for _, tokens in unfed], sessions[0].target)

    def accept(self, tree: DraftTree, path: list[int], verified: TargetOutput) -> None:
        first = len(verified.keys) - self.drafter.tli
        self.accept_rows(tree, path, self.drafter.rows_from_kv(verified.keys, verified.values,
                                                                verified.hidden_states[-1]),
                         verified.keys[first:], verified.values[first:])

    def accept_rows(self, tree: DraftTree, path: list[int], rows: Tensor, tli_keys: list[Tensor],
                    tli_values: list[Tensor]) -> None:
        """`accept` from what a server sends instead of the target's output: the accepted nodes'
        Ekv2E rows [1, n, E] (+ last-TLI-layer K/V), as in serving/."""
        unfed = self._keep(tree, path, rows, tli_keys, tli_values)
        if unfed is not None:
            self.drafter.feed(self.state, unfed[None], self.target)

    def _keep(self, tree: DraftTree, path: list[int], rows: Tensor, tli_keys: list[Tensor], tli_values: list[Tensor],
              row_kv: tuple[Tensor, Tensor] | None = None) -> Tensor | None:
        """The caches compacted to the accepted path, the accepted rows appended; returns the accepted
        tokens SA has not run yet [m] (the last level's leaves), or None."""
        fed = fed_prefix(tree, path)
        self.state.sa.select(keep_index(self.base, fed, self.device))
        self.drafter.extend_rows(self.state, rows, tli_keys, tli_values, row_kv)  # also drops TLI drafts
        return tree.tokens[path[len(fed):]].to(self.device) if len(fed) < len(path) else None
