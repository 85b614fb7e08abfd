"""K-step-bounded training masks (docs/method.md section 2).

An *anchor* stands in for "the last token the target has verified". `last_anchor[b, i]` = s(i),
the last anchor at or before position i. At inference, a drafter k steps past an anchor sees
target activations only up to the anchor: the masks below give training exactly that view, so
one teacher-forced forward trains every draft depth at once.

All masks are boolean, True = may attend, shaped [B, 1, T_q, T_k].

An attention window (MoA's `attention_window`) narrows SA and CA: SA's query at position p reads
only keys at positions p - W + 1 .. p (`within_window`: key column j stands for position j, true
of every key that can be that old, since only a round's drafted nodes sit at other columns, and
they are recent); CA reads only the last W rows it may read, s(i) - W + 1 .. s(i)
(`within_last_rows`). Both are what vLLM's paged attention does with a sliding window of W (the
query aligned to the last key it reads), so the proposer inside vLLM reads the same keys.
"""

from __future__ import annotations

import torch
from torch import Tensor


def anchor_flags(length: int, prompt_length: int, every: int, device: torch.device | str = "cpu") -> Tensor:
    """Anchors of one sequence: all prompt positions, and response positions whose distance from
    the last prompt token is a multiple of `every`. So the first response token is drafted one
    step past the prompt, from target rows that end at the prompt, as it is after a prefill (with
    the first response token as an anchor too, that case would never be trained). Position 0 is
    always an anchor. -> [T] bool"""
    if every < 1:
        raise ValueError(f"anchor spacing 'every' must be >= 1, got {every}")
    positions = torch.arange(length, device=device)
    flags = (positions < prompt_length) | ((positions - (prompt_length - 1)) % every == 0)
    flags[0] = True
    return flags


def last_anchor(flags: Tensor) -> Tensor:
    """[B, T] anchor flags -> s [B, T]: index of the last anchor at or before each position."""
    positions = torch.arange(flags.shape[-1], device=flags.device).expand_as(flags)
    marked = torch.where(flags, positions, torch.zeros_like(positions))
    return torch.cummax(marked, dim=-1).values


def draft_depth(s: Tensor) -> Tensor:
    """[B, T] -> k = i - s(i): how many steps past its anchor each position drafts."""
    positions = torch.arange(s.shape[-1], device=s.device)
    return positions - s


def cross_attention_mask(s: Tensor) -> Tensor:
    """CA: position i reads target rows j <= s(i). [B, T] -> [B, 1, T, T]"""
    j = torch.arange(s.shape[-1], device=s.device)
    return (j[None, None, :] <= s[:, :, None])[:, None]


def self_attention_mask(s: Tensor, staircase: Tensor | None = None) -> Tensor:
    """SA: causal; with the staircase (per sample, [B] bool) position i sees only tokens
    s(i)+1..i plus itself. [B, T] -> [B, 1, T, T]"""
    t = s.shape[-1]
    i = torch.arange(t, device=s.device)
    causal = (i[None, :] <= i[:, None])[None].expand(s.shape[0], t, t)
    if staircase is None:
        return causal[:, None]
    stair = causal & ((i[None, None, :] > s[:, :, None]) | (i[None, None, :] == i[None, :, None]))
    return torch.where(staircase[:, None, None], stair, causal)[:, None]


def target_layers_mask(s: Tensor) -> Tensor:
    """TLI: the target's last N layers, run on predicted hidden states, attend over
    [true rows (the target's own K/V); predicted rows]: true j <= s(i), predicted s(i) < j <= i.
    [B, T] -> [B, 1, T, 2T]"""
    i = torch.arange(s.shape[-1], device=s.device)
    true_part = i[None, None, :] <= s[:, :, None]
    pred_part = (i[None, None, :] > s[:, :, None]) & (i[None, None, :] <= i[None, :, None])
    return torch.cat([true_part, pred_part], dim=-1)[:, None]


def within_window(mask: Tensor | None, query_positions: Tensor, num_keys: int, window: int) -> Tensor | None:
    """`mask` (None: every key) narrowed to the last `window` positions before and at each query:
    key column j is read by a query at position p only if p - window < j. query_positions [B, T];
    mask broadcastable to [B, 1, T, num_keys] -> [B, 1, T, num_keys] (window 0: `mask` as it is)."""
    if window <= 0:
        return mask
    j = torch.arange(num_keys, device=query_positions.device)
    recent = (j[None, None, :] > query_positions[:, :, None] - window)[:, None]  # [B, 1, T, S]
    return recent if mask is None else mask & recent


def within_last_rows(mask: Tensor | None, num_keys: int, window: int,
                     device: torch.device | str = "cpu") -> Tensor | None:
    """CA's window: `mask` (None: every row) narrowed to the last `window` rows each query may read,
    m - window + 1 .. m where m is its last readable column (s(i) in training, the last verified
    row when drafting). mask broadcastable to [B, 1, T, num_keys] -> the same shape (window 0:
    `mask` as it is); a query that reads no row keeps reading none."""
    if window <= 0:
        return mask
    if mask is None:
        if num_keys <= window:
            return None
        return (torch.arange(num_keys, device=device) >= num_keys - window)[None, None, None]  # [1, 1, 1, S]
    j = torch.arange(num_keys, device=mask.device)
    last = torch.where(mask, j, torch.full_like(j, -1)).amax(dim=-1, keepdim=True)  # [..., T, 1]
    return mask & (j > last - window)
