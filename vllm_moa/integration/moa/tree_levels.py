"""The drafter's tree levels inside vLLM (tree_drafts.py grows trees with them), outside vLLM's
draft loop: the same SA and CA blocks as the paged forward (draft_model.MoASelfAttention /
MoACrossAttention's project / queries / finish), with the attention between them a dense masked
one over K/V gathered from the paged caches once per step (`tree_context`): a tree level's nodes
see their request's prefix and their own ancestors, a mask vLLM's paged attention cannot take.
With the drafter's attention window W, SA's prefix is read from position root - W + 1 on and a
node at position p sees the prefix positions after p - W; CA reads the last W rows (as the
paged forward and models/masks.py do). TLI = 0 drafters (draft_config refuses trees for TLI > 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_moa.kernels.paged import gather_slots, split_kv_cache
from vllm_moa.kernels.paged import slot_mapping as paged_slots


class TreeContext:
    """A step's tree drafting state, per request b: SA's cached prefix K/V, CA's row K/V, and the
    SA K/V of the tree nodes fed so far (None before the first level); each [n, H_kv, d]."""

    def __init__(self, window: int = 0) -> None:
        self.window = window  # the drafter's attention_window (0: none)
        self.sa: list[tuple[Tensor, Tensor]] = []
        self.sa_start: list[int] = []  # the position of each request's first SA prefix entry
        self.ca: list[tuple[Tensor, Tensor]] = []
        self.fed: list[tuple[Tensor, Tensor] | None] = []


@torch.inference_mode()
def tree_context(model, layout: Callable, block_table: Tensor, root_positions: list[int]) -> TreeContext:
    """Per request of the batch: SA's cached K/V at positions 0..root (the verified tokens and the
    root the first pass just ran) and CA's rows 0..root-1 (the verified tokens), read from the
    paged caches once per step. model: the MoADraftModel; block_table [B, max_blocks]: the
    drafter's layers' kernel block table."""
    sa_cache, ca_cache = model.model.sa.attn.kv_cache, model.model.ca.attn.kv_cache
    block_size = split_kv_cache(sa_cache, layout)[0].shape[1]
    window = model.config.attention_window
    context = TreeContext(window)
    for b, root in enumerate(root_positions):
        # CA reads rows first..root-1 (the last W), SA positions first+1..root with a window (a node
        # at root + k >= root + 1 reads no older), 0..root without
        first = max(0, root - window) if window else 0
        slots = paged_slots(block_table[b], torch.arange(first, root + 1, device=block_table.device), block_size)
        start = first + 1 if window and root >= window else first
        context.sa.append(gather_slots(sa_cache, slots[start - first:], layout))
        context.sa_start.append(start)
        context.ca.append(gather_slots(ca_cache, slots[:-1], layout))
        context.fed.append(None)
    return context


@torch.inference_mode()
def tree_level(model, context: TreeContext, input_ids: Tensor, positions: Tensor,
               levels: list[tuple[int, slice, Tensor]]) -> Tensor:
    """One tree level of several requests: input_ids, positions [T] -> logits [T, V].

    levels: (request b, its rows of the T, visible [n, F + n]) with decoding/tree.py's meaning:
    which of the request's fed nodes (F so far, then these n) each row sees; every row also sees
    SA's cached prefix. Fed slot 0 is the root, which sits in that prefix already: its entry is a
    masked placeholder. The rows' SA K/V are appended to context.fed[b]."""
    sa, ca = model.model.sa, model.model.ca
    hidden = model.model.embed_tokens(input_ids)  # [T, E]
    q, k, v = sa.project(positions, hidden)
    heads, kv_heads, d = sa.num_heads, sa.num_kv_heads, sa.head_dim  # this rank's
    q, k, v = q.view(-1, heads, d), k.view(-1, kv_heads, d), v.view(-1, kv_heads, d)
    attended = torch.empty_like(q)  # [T, H, d]
    for b, rows, visible in levels:
        fed = context.fed[b]
        if fed is None:  # placeholder for the root (fed slot 0)
            fed = (k.new_zeros(1, kv_heads, d), v.new_zeros(1, kv_heads, d))
        fed = (torch.cat([fed[0], k[rows]]), torch.cat([fed[1], v[rows]]))
        context.fed[b] = fed
        prefix_k, prefix_v = context.sa[b]
        prefix = visible.new_ones(visible.shape[0], prefix_k.shape[0])
        if context.window:  # prefix position j is read by a node at position p if j > p - W
            j = context.sa_start[b] + torch.arange(prefix_k.shape[0], device=positions.device)
            prefix = j[None, :] > positions[rows][:, None] - context.window
        mask = torch.cat([prefix, visible], dim=1)
        mask[:, prefix_k.shape[0]] = False  # the root's placeholder: the root is in the prefix
        attended[rows] = _attention(q[rows], torch.cat([prefix_k, fed[0]]), torch.cat([prefix_v, fed[1]]), mask)
    hidden = sa.finish(hidden, attended.view(attended.shape[0], -1))
    cq = ca.queries(positions, hidden).view(-1, ca.num_heads, ca.head_dim)
    crossed = torch.empty_like(cq)
    for b, rows, _ in levels:
        row_k, row_v = context.ca[b]
        crossed[rows] = _attention(cq[rows], row_k, row_v, None)
    hidden = ca.finish(hidden, crossed.view(crossed.shape[0], -1))
    return model.compute_logits(model.model.out_norm(hidden))


def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """q [n, H, d], k/v [m, H_kv, d], mask [n, m] bool or None -> [n, H, d] (scale d^-1/2)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).to(q.dtype),
                                         v.transpose(0, 1).to(q.dtype), attn_mask=None if mask is None else mask[None])
    return out.transpose(0, 1)
