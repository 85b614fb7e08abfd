"""Tree attention on CPU, planned once per engine step.

Inside an engine every attention layer of the target verifies the same trees: the same blocks,
the same prefix lengths, the same ancestor masks. ``plan_tree_attention`` reads those once per
step (each tree's blocks and its additive mask, 0 or -inf); ``tree_attention_planned`` then runs
a layer with few, small operations per tree (the twin, ``tree_attention_reference``, gathers
every key slot by slot, repeats K/V for each query head of a GQA group and rebuilds the mask, at
every layer):

* the tree's whole blocks are copied out of the cache in one ``index_select``
  (``paged.gather_blocks``), K then laid out [H_kv, d, L] and V [H_kv, L, d] from them;
* the query heads of a GQA group share their KV head as extra query rows: q [n, H, d] ->
  [H_kv, g * n, d] (query head h reads KV head h // g, as in the twin), nothing repeated;
* scores = scale * q K + mask (``baddbmm``), softmax, times V (``bmm``).

The maths are the twin's (kernels/tree.py's conventions); tests/unit/kernels/test_kernels_tree_cpu.py
compares them. On an AMD EPYC, one SmolLM2 layer (9 heads, 3 KV heads, d = 64) over a 250-token
prefix and a 5-node tree: about 130 us against 340-400 us for the twin (hand timings).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .paged import Layout, gather_blocks
from .tree import ancestor_bits


@dataclass(frozen=True)
class TreeAttentionPlan:
    """Per tree b: its query rows, the blocks holding its L_b = P_b + n_b keys, its mask."""

    spans: tuple[tuple[int, int], ...]  # (cu[b], cu[b + 1])
    blocks: tuple[Tensor, ...]  # [ceil(L_b / block_size)] int64
    bias: tuple[Tensor, ...]  # [groups * n_b, L_b] float32: 0 where allowed, -inf elsewhere
    groups: int  # query heads per KV head (the mask's rows repeat for each)


def plan_tree_attention(block_tables: Tensor, prefix_lens: Tensor, cu_seqlens_q: Tensor, ancestor_masks: Tensor,
                        block_size: int, groups: int = 1) -> TreeAttentionPlan:
    """What every layer of a step shares (the arguments as in kernels/tree.py; `groups`: H / H_kv)."""
    cu, prefix = cu_seqlens_q.tolist(), prefix_lens.tolist()
    spans, blocks, bias = [], [], []
    for b in range(len(cu) - 1):
        lo, hi = cu[b], cu[b + 1]
        n, p = hi - lo, prefix[b]
        if n == 0:
            continue
        allowed = torch.cat([torch.ones(n, p, dtype=torch.bool, device=ancestor_masks.device),
                             ancestor_bits(ancestor_masks[lo:hi], n)], dim=1)  # [n, P + n]
        spans.append((lo, hi))
        blocks.append(block_tables[b, : -(-(p + n) // block_size)].long())
        additive = torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        bias.append(additive.repeat(groups, 1))
    return TreeAttentionPlan(tuple(spans), tuple(blocks), tuple(bias), groups)


@torch.no_grad()
def tree_attention_planned(q: Tensor, kv_cache: Tensor, plan: TreeAttentionPlan, *, layout: Layout = "flash_attn",
                           sm_scale: float | None = None) -> Tensor:
    """q [T, H, d] -> [T, H, d]: tree attention over one layer's cache, for the plan's trees."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    out = torch.empty_like(q)
    for (lo, hi), blocks, bias in zip(plan.spans, plan.blocks, plan.bias):
        n, length = hi - lo, bias.shape[1]
        k, v = gather_blocks(kv_cache, blocks, layout)  # each [nb, bs, H_kv, d]
        kv_heads = k.shape[2]
        groups = num_heads // kv_heads
        if groups != plan.groups:
            raise ValueError(f"the plan's mask is for {plan.groups} query heads per KV head, this layer has {groups}")
        keys = k.permute(2, 3, 0, 1).reshape(kv_heads, head_dim, -1)[..., :length].to(q.dtype)  # [H_kv, d, L]
        values = v.permute(2, 0, 1, 3).reshape(kv_heads, -1, head_dim)[:, :length].to(q.dtype)  # [H_kv, L, d]
        queries = q[lo:hi].reshape(n, kv_heads, groups, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, groups * n, head_dim)
        probs = torch.baddbmm(bias.to(q.dtype), queries, keys, alpha=scale).softmax(dim=-1)  # [H_kv, g * n, L]
        heads = torch.bmm(probs, values)  # [H_kv, g * n, d]
        out[lo:hi] = heads.view(kv_heads, groups, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
    return out
