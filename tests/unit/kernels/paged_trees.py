"""Paged caches holding draft trees, shared by the tree-attention tests (the Triton kernel's and
the planned CPU path's): each sequence's prefix then its tree tokens, blocks handed out in a
shuffled order (so a sequence's blocks are non-contiguous), garbage everywhere else."""

from __future__ import annotations

import math

import torch

from vllm_moa.integration.shell.compat import cpu_vec_kv_layout
from vllm_moa.kernels import new_kv_cache, slot_mapping, tree_ancestor_masks, write_slots

BLOCK_SIZE = 16


def _new_cache(num_blocks, num_kv_heads, head_dim, layout):
    if layout is cpu_vec_kv_layout:  # CPU_ATTN: [num_blocks, H_kv, block_size, 2d], K transposed per block and head
        return torch.zeros(num_blocks, num_kv_heads, BLOCK_SIZE, 2 * head_dim)
    return new_kv_cache(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, layout=layout)


def build_batch(trees, prefixes, num_kv_heads, head_dim, dtype, device, layout="flash_attn", seed=0):
    """-> (cache, block_tables, prefix_lens, cu_seqlens, ancestor_masks) in kernels/tree.py's
    conventions; `layout` a named layout or compat.cpu_vec_kv_layout."""
    g = torch.Generator().manual_seed(seed)
    sizes = [len(t) for t in trees]
    blocks_per_seq = [math.ceil((p + n) / BLOCK_SIZE) for p, n in zip(prefixes, sizes)]
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=g)
    block_tables = torch.full((len(trees), max_blocks), num_blocks - 1, dtype=torch.int32)  # padding
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        block_tables[b, :nb] = order[used:used + nb].to(torch.int32)
        used += nb
    cache = _new_cache(num_blocks, num_kv_heads, head_dim, layout)
    cache.copy_(torch.randn(cache.shape, generator=g))  # garbage everywhere else
    for b, (p, n) in enumerate(zip(prefixes, sizes)):
        slots = slot_mapping(block_tables[b].long(), torch.arange(p + n), BLOCK_SIZE)
        write_slots(cache, slots, torch.randn(p + n, num_kv_heads, head_dim, generator=g),
                    torch.randn(p + n, num_kv_heads, head_dim, generator=g), layout)
    cu = torch.tensor([0] + sizes).cumsum(0).to(torch.int32)
    masks = tree_ancestor_masks(torch.tensor(sum(trees, [])), cu)
    return (cache.to(device=device, dtype=dtype), block_tables.to(device), torch.tensor(prefixes, dtype=torch.int32,
            device=device), cu.to(device), masks.to(device))
