"""The target's KV cache for a batch of sequences of different lengths.

Per layer one buffer k, v [B, H_kv, capacity, d]; sequence b holds its verified tokens in slots
0..lengths[b]-1. A round writes each sequence's N new tokens (a draft tree, padded to the batch's
largest) at slots lengths[b] .. lengths[b]+N-1, the forward attends the first max(lengths) + N
slots under a per-sequence mask (tree.verification_inputs), and `commit` then moves the accepted
path's entries down to lengths[b].. (compaction: nothing is recomputed). Slots past lengths[b] are
scratch. A `target.LayeredKVCache`: `TargetModel.forward` drives it through `append(layer, k, v)`,
like `TargetKVCache`.
"""

from __future__ import annotations

import torch
from torch import Tensor

_GROW = 256  # capacity grows in steps of this many slots


class SlotKVCache:
    def __init__(self, num_layers: int, lengths: list[int] | None = None) -> None:
        self.num_layers = num_layers
        self.k: list[Tensor | None] = [None] * num_layers
        self.v: list[Tensor | None] = [None] * num_layers
        self.lengths: list[int] = list(lengths or [])
        self._write: Tensor | None = None  # [B, N] slots of this round's new tokens
        self._width = 0

    @property
    def length(self) -> int:
        return max(self.lengths, default=0)

    def begin_round(self, num_new: int, device: torch.device) -> int:
        """The next forward writes `num_new` tokens per sequence; returns the visible width."""
        start = torch.tensor(self.lengths, device=device)[:, None]
        self._write = start + torch.arange(num_new, device=device)[None]
        self._width = self.length + num_new
        return self._width

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [B, H_kv, N, d] of this round's tokens -> the layer's visible K/V [B, H_kv, width, d]."""
        if self.k[layer] is None or self.k[layer].shape[2] < self._width:
            self._grow(layer, k)
        index = self._write[:, None, :, None].expand_as(k)
        self.k[layer].scatter_(2, index, k)
        self.v[layer].scatter_(2, index, v)
        return self.k[layer][:, :, : self._width], self.v[layer][:, :, : self._width]

    def _grow(self, layer: int, like: Tensor) -> None:
        b, h, _, d = like.shape
        capacity = -(-self._width // _GROW) * _GROW
        k = like.new_zeros(b, h, capacity, d)
        v = like.new_zeros(b, h, capacity, d)
        if self.k[layer] is not None:
            old = self.k[layer].shape[2]
            k[:, :, :old], v[:, :, :old] = self.k[layer], self.v[layer]
        self.k[layer], self.v[layer] = k, v

    def commit(self, row: int, kept: list[int]) -> None:
        """Sequence `row` keeps its new tokens `kept` (indices into this round's N, in order)."""
        start = self.lengths[row]
        if kept != list(range(len(kept))):  # a chain's accepted prefix is already in place
            src = torch.tensor(kept, device=self.k[0].device) + start
            for layer in range(self.num_layers):
                for buf in (self.k[layer], self.v[layer]):
                    buf[row, :, start : start + len(kept)] = buf[row, :, src]
        self.lengths[row] = start + len(kept)

    def rewind(self, row: int, length: int) -> None:
        """Forget sequence `row`'s tokens from position `length` on (a client that re-syncs from
        an earlier point); the slots become scratch."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"cannot rewind sequence {row} to {length}: it holds {self.lengths[row]} tokens")
        self.lengths[row] = length

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these sequences (finished ones leave the batch)."""
        if rows == list(range(len(self.lengths))):
            return
        if self.k[0] is not None:
            index = torch.tensor(rows, dtype=torch.long, device=self.k[0].device)
            self.k = [k.index_select(0, index) for k in self.k]
            self.v = [v.index_select(0, index) for v in self.v]
        self.lengths = [self.lengths[r] for r in rows]

    def sequence(self, row: int) -> tuple[list[Tensor], list[Tensor]]:
        """Sequence `row`'s verified K/V: per layer [1, H_kv, lengths[row], d]."""
        n = self.lengths[row]
        return ([k[row : row + 1, :, :n] for k in self.k], [v[row : row + 1, :, :n] for v in self.v])
