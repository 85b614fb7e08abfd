"""Paged-cache helpers (PyTorch only): layouts, slots, the LSA row gather, ancestor masks."""

from __future__ import annotations

import pytest
import torch

from vllm_moa.kernels import (
    PagedLayers,
    gather_layer_rows,
    gather_slots,
    new_kv_cache,
    slot_mapping,
    split_kv_cache,
    tree_ancestor_masks,
    write_slots,
)
from vllm_moa.kernels.tree import ancestor_bits
from vllm_moa.target import stack_layer_kv


def _fill_sequences(caches, block_tables, lengths, layout, generator):
    """Write random K/V for positions 0..len-1 of each sequence; return per-layer K/V lists
    [B][L] of [H_kv, T, d] (the unpaged truth)."""
    k_view, _ = split_kv_cache(caches[0], layout)
    block_size, h_kv, d = k_view.shape[1], k_view.shape[2], k_view.shape[3]
    truth = []
    for b, n in enumerate(lengths):
        slots = slot_mapping(block_tables[b], torch.arange(n), block_size)
        per_layer = []
        for cache in caches:
            k = torch.randn(n, h_kv, d, generator=generator)
            v = torch.randn(n, h_kv, d, generator=generator)
            write_slots(cache, slots, k, v, layout)
            per_layer.append((k, v))
        truth.append(per_layer)
    return truth


@pytest.mark.parametrize("layout", ["flash_attn", "blocks_first"])
@pytest.mark.parametrize("stacked", [False, True])
def test_gather_layer_rows_is_stack_layer_kv(layout, stacked):
    g = torch.Generator().manual_seed(0)
    num_layers, h_kv, d, block_size, num_blocks = 3, 2, 8, 16, 9
    if stacked:
        one = new_kv_cache(num_blocks, block_size, h_kv, d, layout=layout)
        caches = torch.stack([one] * num_layers).clone()
        layer_list = list(caches.unbind(0))
    else:
        caches = layer_list = [new_kv_cache(num_blocks, block_size, h_kv, d, layout=layout) for _ in range(num_layers)]
    block_tables = torch.tensor([[7, 2, 5], [0, 8, 3]])  # non-contiguous, out of order
    lengths = [37, 20]
    truth = _fill_sequences(layer_list, block_tables, lengths, layout, g)
    for b, n in enumerate(lengths):
        keys = [k.transpose(0, 1)[None] for k, _ in truth[b]]  # [1, H_kv, T, d]
        values = [v.transpose(0, 1)[None] for _, v in truth[b]]
        want = stack_layer_kv(keys, values)[0]  # [T, L, 2 * H_kv * d]
        slots = slot_mapping(block_tables[b], torch.arange(n), block_size)
        got = gather_layer_rows(caches, slots, layout)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # any subset, any order
    slots = torch.tensor([3 * 16 + 4, 7 * 16, 5 * 16 + 15])
    rows = gather_layer_rows(caches, slots, layout)
    k, v = gather_slots(layer_list[1], slots, layout)
    torch.testing.assert_close(rows[:, 1], torch.cat([k, v], dim=-1).flatten(1), rtol=0, atol=0)


def test_flash_attn_layout_is_k_then_v():
    cache = new_kv_cache(4, 16, 2, 8)
    write_slots(cache, torch.tensor([17]), torch.ones(1, 2, 8), 2 * torch.ones(1, 2, 8))
    assert cache[0, 1, 1].eq(1).all() and cache[1, 1, 1].eq(2).all()
    assert cache.sum() == 1 * 16 + 2 * 16


def test_slot_mapping():
    bt = torch.tensor([[4, 1, 6]])
    got = slot_mapping(bt, torch.tensor([[0, 15, 16, 40]]), 16)
    assert got.tolist() == [[64, 79, 16, 6 * 16 + 8]]


def test_paged_layers_addresses_separate_allocations():
    caches = [new_kv_cache(5, 16, 2, 64, dtype=torch.bfloat16) for _ in range(4)]
    paged = PagedLayers.from_caches(caches)
    item = caches[0].element_size()
    assert paged.num_layers == 4 and paged.row_width == 2 * 2 * 64 and paged.block_size == 16
    for layer, cache in enumerate(caches):
        k, v = split_kv_cache(cache)
        assert int(paged.layer_offsets[layer]) * item == k.data_ptr() - paged.base.data_ptr()
        assert paged.v_offset * item == v.data_ptr() - k.data_ptr()
    assert paged.strides == tuple(caches[0][0].stride())


def test_paged_layers_refuses_mismatched_layers():
    a = new_kv_cache(5, 16, 2, 64)
    with pytest.raises(ValueError, match="differs from layer 0"):
        PagedLayers.from_caches([a, new_kv_cache(6, 16, 2, 64)])
    with pytest.raises(ValueError, match="flash_attn layout"):
        split_kv_cache(a[0])
    with pytest.raises(ValueError, match="unknown KV cache layout"):
        split_kv_cache(a, "nope")


def _brute_force_ancestors(parents):
    n = len(parents)
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            out[i, j] = True
            j = parents[j]
    return out


@pytest.mark.parametrize("parents", [
    [-1],
    [-1, 0, 1, 2, 3],  # chain
    [-1] + [0] * 63,  # full width: root and 63 children
    [-1, -1, 0, 0, 1, 2, 4, 4],  # forest hanging off the prefix
    list(range(-1, 63)),  # 64-deep chain: bit 63 is the int64 sign bit
])
def test_tree_ancestor_masks(parents):
    masks = tree_ancestor_masks(parents)
    assert masks.dtype == torch.int64
    assert torch.equal(ancestor_bits(masks, len(parents)), _brute_force_ancestors(parents))


def test_tree_ancestor_masks_ragged_batch():
    trees = [[-1, 0, 0], [-1], [-1, 0, 1, 1]]
    flat = torch.tensor(sum(trees, []))
    cu = torch.tensor([0, 3, 4, 8])
    masks = tree_ancestor_masks(flat, cu)
    for b, tree in enumerate(trees):
        got = ancestor_bits(masks[cu[b]:cu[b + 1]], len(tree))
        assert torch.equal(got, _brute_force_ancestors(tree))


@pytest.mark.parametrize("parents, message", [
    ([-1, 2, 1], "cycle"),
    ([-1, 5], "another node"),
    ([0], "another node"),
    ([-1] * 65, "more than 64"),
])
def test_tree_ancestor_masks_rejects(parents, message):
    with pytest.raises(ValueError, match=message):
        tree_ancestor_masks(parents)
