"""Tree attention on CPU, planned once per step (kernels/tree_cpu.py), against the twin
(tree_attention_reference: a dense boolean mask + SDPA per tree), on ragged trees, GQA groups,
non-contiguous blocks and each cache layout (a CPU_ATTN-like callable included: K stored
transposed per block and head)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_moa.kernels import (
    gather_blocks,
    new_kv_cache,
    plan_tree_attention,
    slot_mapping,
    split_kv_cache,
    tree_ancestor_masks,
    tree_attention_planned,
    tree_attention_reference,
    write_slots,
)

BLOCK_SIZE = 16


def cpu_vec_like(kv_cache):
    """[num_blocks, H_kv, block_size, 2d]: per block and head, K transposed then V (CPU_ATTN's)."""
    num_blocks, heads, block_size, two_d = kv_cache.shape
    d = two_d // 2
    per_head = kv_cache.view(num_blocks, heads, 2 * block_size * d)
    k = per_head[..., : block_size * d].unflatten(-1, (d, block_size)).permute(0, 3, 1, 2)
    v = per_head[..., block_size * d:].unflatten(-1, (block_size, d)).permute(0, 2, 1, 3)
    return k, v


def _cache(layout, num_blocks, heads, d, g):
    if layout == "cpu_vec":
        return torch.randn(num_blocks, heads, BLOCK_SIZE, 2 * d, generator=g), cpu_vec_like
    cache = new_kv_cache(num_blocks, BLOCK_SIZE, heads, d, layout=layout)
    return cache.copy_(torch.randn(cache.shape, generator=g)), layout


@pytest.mark.parametrize("layout", ["flash_attn", "blocks_first", "cpu_vec"])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (6, 2)])
def test_planned_tree_attention_equals_the_twin(layout, heads, kv_heads):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    d = 32
    trees = [[-1, 0, 0, 1, 2], [-1], [-1, 0, 1, 1, 0, 4, -1, 6], [-1, 0, 0, 0]]
    prefixes = [37, 0, 16, 250]
    sizes = [len(t) for t in trees]
    per_seq = [math.ceil((p + n) / BLOCK_SIZE) for p, n in zip(prefixes, sizes)]
    num_blocks = sum(per_seq) + 5
    order = torch.randperm(num_blocks, generator=g)  # a sequence's blocks are scattered
    block_tables = torch.full((len(trees), max(per_seq) + 2), num_blocks - 1, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(per_seq):
        block_tables[b, :nb] = order[used: used + nb].to(torch.int32)
        used += nb
    cache, reader = _cache(layout, num_blocks, kv_heads, d, g)
    for b, (p, n) in enumerate(zip(prefixes, sizes)):
        slots = slot_mapping(block_tables[b].long(), torch.arange(p + n), BLOCK_SIZE)
        write_slots(cache, slots, torch.randn(p + n, kv_heads, d, generator=g),
                    torch.randn(p + n, kv_heads, d, generator=g), reader)
    cu = torch.tensor([0] + sizes).cumsum(0).to(torch.int32)
    masks = tree_ancestor_masks(torch.tensor(sum(trees, [])), cu)
    prefix_lens = torch.tensor(prefixes, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, d, generator=g)
    plan = plan_tree_attention(block_tables, prefix_lens, cu, masks, BLOCK_SIZE)
    for scale in (None, 0.3):
        want = tree_attention_reference(q, cache, block_tables, prefix_lens, cu, masks, layout=reader, sm_scale=scale)
        got = tree_attention_planned(q, cache, plan, layout=reader, sm_scale=scale)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["flash_attn", "blocks_first", "cpu_vec"])
def test_gathered_blocks_are_the_cache_blocks(layout):
    g = torch.Generator().manual_seed(0)
    cache, reader = _cache(layout, 7, 2, 8, g)
    blocks = torch.tensor([5, 0, 3])
    k, v = gather_blocks(cache, blocks, reader)
    kc, vc = split_kv_cache(cache, reader)
    assert torch.equal(k, kc[blocks]) and torch.equal(v, vc[blocks])
