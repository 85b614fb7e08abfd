"""Slices of the target's outputs (TargetOutput: logits, per-layer hidden states and K/V) that the
engine hands to drafters: one sequence's rows of a batched round, the last n tokens, consecutive
rounds joined, and the plain rounds a lagging drafter has not seen yet."""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_moa.target import TargetOutput


class PlainRound:
    """A plain round's target outputs (no logits), kept while some sequence's drafter lags; stacked
    over layers on first use, once for all the batch's sequences (three tensors, not one per layer)."""

    def __init__(self, out: TargetOutput) -> None:
        self.out: TargetOutput | None = TargetOutput(no_logits(out), out.hidden_states, out.keys, out.values)
        self.no_logits = self.out.logits
        self._stacked: tuple[Tensor, Tensor, Tensor] | None = None

    def stacked(self) -> tuple[Tensor, Tensor, Tensor]:
        """hidden states [L+1, B, 1, E], keys and values [L, B, H_kv, 1, d]"""
        if self._stacked is None:
            out, self.out = self.out, None
            self._stacked = (torch.stack(out.hidden_states), torch.stack(out.keys), torch.stack(out.values))
        return self._stacked


def lag_outputs(lag: list[tuple[int, PlainRound, int]]) -> TargetOutput:
    """One sequence's target outputs over its lagging plain rounds' tokens, each tensor [1, n, ...]."""
    parts = [(plain.stacked(), row) for _, plain, row in lag]
    hidden = torch.cat([h[:, row : row + 1, :1] for (h, _, _), row in parts], dim=2)  # [L+1, 1, n, E]
    keys = torch.cat([k[:, row : row + 1, :, :1] for (_, k, _), row in parts], dim=3)  # [L, 1, H_kv, n, d]
    values = torch.cat([v[:, row : row + 1, :, :1] for (_, _, v), row in parts], dim=3)
    return TargetOutput(lag[0][1].no_logits, list(hidden.unbind(0)), list(keys.unbind(0)), list(values.unbind(0)))




def concat_outputs(parts: list[TargetOutput]) -> TargetOutput:
    """Outputs of consecutive tokens (rows_of of successive rounds) as one, along the token axis."""
    if len(parts) == 1:
        return parts[0]
    return TargetOutput(
        torch.cat([p.logits for p in parts], dim=1),
        [torch.cat(hs, dim=1) for hs in zip(*(p.hidden_states for p in parts))],
        [torch.cat(ks, dim=2) for ks in zip(*(p.keys for p in parts))],
        [torch.cat(vs, dim=2) for vs in zip(*(p.values for p in parts))],
    )


def no_logits(out: TargetOutput) -> Tensor:
    """[1, 0, V]: a tensor of its own (an empty view would keep all the logits alive)."""
    return out.logits.new_empty((1, 0, out.logits.shape[-1]))


def last_tokens(out: TargetOutput, n: int) -> TargetOutput:
    """The outputs of the last n tokens (each tensor [1, n, ...])."""
    return TargetOutput(out.logits[:, -n:], [h[:, -n:] for h in out.hidden_states],
                        [k[:, :, -n:] for k in out.keys], [v[:, :, -n:] for v in out.values])


def rows_of(out: TargetOutput, row: int, nodes: list[int], logits: bool = True) -> TargetOutput:
    """The target's output for sequence `row` at the given nodes, each tensor [1, n, ...] (logits
    False: [1, 0, V], for sessions, which never read them); views where the nodes are consecutive."""
    if nodes == list(range(nodes[0], nodes[0] + len(nodes))):
        first, n = nodes[0], len(nodes)
        return TargetOutput(
            out.logits[row : row + 1, first : first + n] if logits else no_logits(out),
            [h[row : row + 1, first : first + n] for h in out.hidden_states],
            [k[row : row + 1, :, first : first + n] for k in out.keys],
            [v[row : row + 1, :, first : first + n] for v in out.values],
        )
    index = torch.tensor(nodes, device=out.logits.device)
    return TargetOutput(
        out.logits[row : row + 1].index_select(1, index) if logits else no_logits(out),
        [h[row : row + 1].index_select(1, index) for h in out.hidden_states],
        [k[row : row + 1].index_select(2, index) for k in out.keys],
        [v[row : row + 1].index_select(2, index) for v in out.values],
    )
