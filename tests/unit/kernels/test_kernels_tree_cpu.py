"""Tree attention on CPU, planned once per step (kernels/tree_cpu.py), against the twin
(tree_attention_reference: a dense boolean mask + SDPA per tree), on ragged trees, GQA groups,
non-contiguous blocks and each cache layout (CPU_ATTN's included: K stored transposed per block
and head)."""

from __future__ import annotations

import pytest
import torch
from paged_trees import BLOCK_SIZE, build_batch

from vllm_moa.integration.shell.compat import cpu_vec_kv_layout
from vllm_moa.kernels import (
    gather_blocks,
    new_kv_cache,
    plan_tree_attention,
    split_kv_cache,
    tree_attention_planned,
    tree_attention_reference,
)

LAYOUTS = {"flash_attn": "flash_attn", "blocks_first": "blocks_first", "cpu_vec": cpu_vec_kv_layout}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (6, 2)])
def test_planned_tree_attention_equals_the_twin(layout, heads, kv_heads):
    reader = LAYOUTS[layout]
    trees = [[-1, 0, 0, 1, 2], [-1], [-1, 0, 1, 1, 0, 4, -1, 6], [-1, 0, 0, 0]]
    cache, block_tables, prefix_lens, cu, masks = build_batch(
        trees, [37, 0, 16, 250], kv_heads, 32, torch.float32, "cpu", layout=reader, seed=heads * 10 + kv_heads)
    q = torch.randn(int(cu[-1]), heads, 32, generator=torch.Generator().manual_seed(1))
    plan = plan_tree_attention(block_tables, prefix_lens, cu, masks, BLOCK_SIZE, heads // kv_heads)
    for scale in (None, 0.3):
        want = tree_attention_reference(q, cache, block_tables, prefix_lens, cu, masks, layout=reader, sm_scale=scale)
        got = tree_attention_planned(q, cache, plan, layout=reader, sm_scale=scale)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gathered_blocks_are_the_cache_blocks(layout):
    reader = LAYOUTS[layout]
    g = torch.Generator().manual_seed(0)
    if layout == "cpu_vec":
        cache = torch.randn(7, 2, BLOCK_SIZE, 16, generator=g)
    else:
        cache = new_kv_cache(7, BLOCK_SIZE, 2, 8, layout=layout)
        cache.copy_(torch.randn(cache.shape, generator=g))
    blocks = torch.tensor([5, 0, 3])
    k, v = gather_blocks(cache, blocks, reader)
    kc, vc = split_kv_cache(cache, reader)
    assert torch.equal(k, kc[blocks]) and torch.equal(v, vc[blocks])
