"""Tree attention over a paged KV cache (verification of a drafted token tree in one pass).

Conventions
-----------
A batch of B sequences; sequence b has ``P_b`` cached prefix tokens and a tree of ``n_b`` nodes
(1 <= n_b <= 64, ragged across the batch). The tree's tokens have been written into the same
paged cache right after the prefix, node j at position ``P_b + j`` (as a serving engine does when
it schedules the tree's tokens: their slots come from the block table like any new token), so
the sequence's keys are positions ``0 .. P_b + n_b - 1`` of its block-table row.

* q               [T, H, d]             T = sum_b n_b tree-token queries, sequence-major
* kv_cache        one layer's paged cache in `layout` (kernels/paged.py), H_kv heads, H % H_kv == 0
* block_tables    [B, max_blocks] int   physical block of each logical block of each sequence
* prefix_lens     [B] int               P_b (tokens before the tree)
* cu_seqlens_q    [B + 1] int           query offsets: tree b is q[cu[b] : cu[b + 1]]
* ancestor_masks  [T] int64             bit j of node i's mask set iff node j (same tree) is an
                                        ancestor of i or i itself (``tree_ancestor_masks``)
* returns         [T, H, d]             in q's dtype

The maths, for node i of sequence b, head h (KV head h // (H / H_kv)), scale = 1/sqrt(d) unless
given::

    allowed(i, p) = p < P_b  or  bit (p - P_b) of ancestor_masks[i]
    out[i, h] = sum_p softmax_p(q[i, h] . K[p] * scale | allowed) V[p]

i.e. ``F.scaled_dot_product_attention`` with that boolean mask (the twin,
``tree_attention_reference``, does exactly this per sequence).

The Triton kernel packs each GQA group's query heads into one tile (K/V read once per group),
streams K/V straight from the paged cache (any block order), and can split the prefix across
programs (flash-decoding) when B * H_kv alone cannot fill the GPU; the partial results are
merged by their log-sum-exp.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ._backend import dot_in_fp32, load_triton_module, use_triton
from .paged import Layout, slot_mapping, split_kv_cache

MAX_TREE_NODES = 64


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# ---------------------------------------------------------------------------------------------
# Trees
# ---------------------------------------------------------------------------------------------
def tree_ancestor_masks(parents: Tensor | Sequence[int], cu_seqlens: Tensor | Sequence[int] | None = None) -> Tensor:
    """Parent arrays -> ancestor bitmasks (int64, one per node, self included).

    parents [T]: for node i of tree b, the index (0-based, within tree b) of its parent, or -1
    for a root (a node hanging directly off the prefix; several roots are allowed).
    cu_seqlens [B + 1]: tree offsets (default: one tree of all T nodes). At most 64 nodes a tree.
    """
    parents = torch.as_tensor(parents, dtype=torch.int64)
    device = parents.device
    t = parents.numel()
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, t], dtype=torch.int64, device=device)
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64, device=device)
    sizes = cu[1:] - cu[:-1]
    if t != int(cu[-1]) or int(cu[0]) != 0 or bool((sizes < 0).any()):
        raise ValueError("cu_seqlens must start at 0, be non-decreasing and end at len(parents)")
    if bool((sizes > MAX_TREE_NODES).any()):
        raise ValueError(f"a tree has more than {MAX_TREE_NODES} nodes (the bitmask is int64)")
    seg = torch.repeat_interleave(torch.arange(sizes.numel(), device=device), sizes)
    start = cu[:-1][seg]
    local = torch.arange(t, device=device) - start
    n_of = sizes[seg]
    if bool(((parents < -1) | (parents >= n_of) | (parents == local)).any()):
        raise ValueError("parents must be -1 (root) or the index of another node of the same tree")
    bits = torch.ones(t, dtype=torch.int64, device=device) << local
    glob = torch.where(parents >= 0, parents + start, torch.full_like(parents, -1))
    anc, p = bits.clone(), glob.clone()
    for _ in range(MAX_TREE_NODES + 1):
        live = p >= 0
        if not bool(live.any()):
            return anc
        anc = torch.where(live, anc | bits[p.clamp(min=0)], anc)
        p = torch.where(live, glob[p.clamp(min=0)], p)
    raise ValueError("parents contain a cycle")


def ancestor_bits(masks: Tensor, n: int) -> Tensor:
    """int64 masks [m] -> bool [m, n]: bit j of masks[i]."""
    j = torch.arange(n, device=masks.device, dtype=torch.int64)
    return ((masks[:, None] >> j[None, :]) & 1).bool()


# ---------------------------------------------------------------------------------------------
# PyTorch twin
# ---------------------------------------------------------------------------------------------
def tree_attention_reference(q: Tensor, kv_cache: Tensor, block_tables: Tensor, prefix_lens: Tensor,
                             cu_seqlens_q: Tensor, ancestor_masks: Tensor, *, layout: Layout = "flash_attn",
                             sm_scale: float | None = None) -> Tensor:
    """Twin of ``tree_attention_triton``: per sequence, gather prefix + tree K/V from the cache,
    build the dense boolean mask [n_b, P_b + n_b] and call ``F.scaled_dot_product_attention``."""
    kc, vc = split_kv_cache(kv_cache, layout)
    block_size, num_kv_heads = kc.shape[1], kc.shape[2]
    num_heads = q.shape[1]
    groups = num_heads // num_kv_heads
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    prefix = prefix_lens.tolist()
    for b in range(len(cu) - 1):
        lo, hi = cu[b], cu[b + 1]
        n, p = hi - lo, prefix[b]
        if n == 0:
            continue
        positions = torch.arange(p + n, device=block_tables.device)
        slots = slot_mapping(block_tables[b], positions, block_size)
        blk, off = slots // block_size, slots % block_size
        k = kc[blk, off].transpose(0, 1)[None]  # [1, H_kv, P + n, d]
        v = vc[blk, off].transpose(0, 1)[None]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        mask = torch.cat([torch.ones(n, p, dtype=torch.bool, device=q.device),
                          ancestor_bits(ancestor_masks[lo:hi].to(q.device), n)], dim=1)
        qb = q[lo:hi].transpose(0, 1)[None]  # [1, H, n, d]
        ob = F.scaled_dot_product_attention(qb, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[None, None],
                                            scale=sm_scale)
        out[lo:hi] = ob[0].transpose(0, 1)
    return out


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------
def _auto_splits(device: torch.device, programs: int, max_prefix: int, block_n: int) -> int:
    """Split the prefix until the grid has ~2 programs per SM, keeping >= 4 key tiles a split."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-2 * sms // max(1, programs))
    most = max(1, max_prefix // (4 * block_n))
    return int(max(1, min(want, most, 32)))


@torch.no_grad()
def tree_attention_triton(q: Tensor, kv_cache: Tensor, block_tables: Tensor, prefix_lens: Tensor,
                          cu_seqlens_q: Tensor, ancestor_masks: Tensor, *, layout: Layout = "flash_attn",
                          sm_scale: float | None = None, num_splits: int | None = None,
                          max_tree_nodes: int | None = None, max_prefix_len: int | None = None) -> Tensor:
    """Tree attention in Triton (see the module docstring for the shapes and the maths).

    num_splits: prefix splits (None: 1 off-GPU, else enough to fill the GPU; needs
    max_prefix_len, read from prefix_lens with a device sync when not given).
    max_tree_nodes: the largest n_b (<= 64); None reads it from cu_seqlens_q (a device sync).
    """
    tree_attention_kernel = load_triton_module("._tree_triton").tree_attention_kernel

    k_cache, v_cache = split_kv_cache(kv_cache, layout)
    if k_cache.stride() != v_cache.stride():
        raise ValueError("K and V views of the cache must have the same strides")
    t, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q [T, {num_heads}, {head_dim}] does not fit a cache of {num_kv_heads} heads of "
                         f"size {k_cache.shape[3]}")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from the cache dtype {k_cache.dtype}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    batch = cu_seqlens_q.numel() - 1
    out = torch.empty(t, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if t == 0 or batch == 0:
        return out
    if max_tree_nodes is None:
        max_tree_nodes = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_tree_nodes > MAX_TREE_NODES:
        raise ValueError(f"trees have at most {MAX_TREE_NODES} nodes, got {max_tree_nodes}")
    group = num_heads // num_kv_heads
    on_gpu = q.device.type == "cuda"
    dot_fp32 = dot_in_fp32(q.dtype, q.device)
    block_d = max(16, _next_pow2(head_dim))
    block_m = max(16, min(128 if head_dim <= 128 or not on_gpu else 64, _next_pow2(group * max_tree_nodes)))
    block_n = (32 if block_d > 128 or dot_fp32 else 64) if on_gpu else 64
    m_tiles = -(-group * max_tree_nodes // block_m)
    if num_splits is None:
        if on_gpu:
            if max_prefix_len is None:
                max_prefix_len = int(prefix_lens.max())
            num_splits = _auto_splits(q.device, m_tiles * batch * num_kv_heads, max_prefix_len, block_n)
        else:
            num_splits = 1
    num_splits = max(1, int(num_splits))
    anc = ancestor_masks.to(device=q.device, dtype=torch.int64).contiguous()
    block_tables = block_tables.to(q.device)
    prefix_lens = prefix_lens.to(device=q.device, dtype=torch.int32).contiguous()
    cu = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
    scale = sm_scale if sm_scale is not None else head_dim ** -0.5
    if num_splits == 1:
        part, lse = out[None], out  # lse unused
    else:
        part = torch.empty(num_splits, t, num_heads, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_splits, t, num_heads, dtype=torch.float32, device=q.device)
    s_blk, s_off, s_head, s_dim = k_cache.stride()
    grid = (m_tiles, batch * num_kv_heads, num_splits)
    tree_attention_kernel[grid](
        q, part, lse, k_cache, v_cache, block_tables, prefix_lens, cu, anc,
        num_kv_heads, group, head_dim, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0) if num_splits > 1 else 0, lse.stride(1) if num_splits > 1 else 0,
        block_size, s_blk, s_off, s_head, s_dim, block_tables.stride(0),
        NUM_SPLITS=num_splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_FP32=dot_fp32,
        num_warps=4 if block_m * block_d <= 64 * 64 else 8, num_stages=2 if on_gpu else 1,
    )
    if num_splits == 1:
        return out
    top = lse.max(dim=0).values
    weight = torch.exp2(lse - top[None])  # [S, T, H]; splits with no keys weigh 0
    merged = (part * weight[..., None]).sum(0) / weight.sum(0)[..., None]
    return merged.to(q.dtype)


def tree_attention_paged(q: Tensor, kv_cache: Tensor, block_tables: Tensor, prefix_lens: Tensor,
                         cu_seqlens_q: Tensor, ancestor_masks: Tensor, *, layout: Layout = "flash_attn",
                         sm_scale: float | None = None, backend: str | None = None, **triton_kwargs) -> Tensor:
    """Tree attention [T, H, d]: ``tree_attention_triton`` or ``tree_attention_reference``, as
    ``use_triton`` decides for q's device ($VLLM_MOA_KERNELS, or `backend`). Extra keyword
    arguments (num_splits, max_tree_nodes, max_prefix_len) go to the Triton kernel only."""
    if use_triton(q.device, backend):
        return tree_attention_triton(q, kv_cache, block_tables, prefix_lens, cu_seqlens_q, ancestor_masks,
                                     layout=layout, sm_scale=sm_scale, **triton_kwargs)
    return tree_attention_reference(q, kv_cache, block_tables, prefix_lens, cu_seqlens_q, ancestor_masks,
                                    layout=layout, sm_scale=sm_scale)
