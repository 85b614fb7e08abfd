"""Tree attention over a paged KV cache: the Triton kernel against its twin (masked SDPA), and the
twin against a brute-force per-query softmax.

Tolerances: fp32 1e-4 absolute (+1e-4 relative); bf16 2e-2 absolute (+2e-2 relative) against the
twin evaluated in fp32 on the same bf16 inputs (the kernel accumulates in fp32; the bf16 twin
lands within the same bound).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from paged_trees import BLOCK_SIZE, build_batch  # noqa: E402

from vllm_moa.kernels import (  # noqa: E402
    slot_mapping,
    tree_attention_paged,
    tree_attention_reference,
    tree_attention_triton,
)
from vllm_moa.kernels.tree import ancestor_bits  # noqa: E402

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

TREES = {
    "single": [-1],
    "chain": [-1, 0, 1, 2, 3, 4, 5, 6, 7],
    "wide": [-1] + [0] * 63,  # full width: a root and 63 children (64 nodes)
    "branchy": [-1, 0, 0, 1, 1, 2, 3, 3, 5, -1, 9, 10],  # two roots hanging off the prefix
    "deep64": list(range(-1, 63)),  # 64-deep chain: the last node needs bit 63
}


def make_q(total, num_heads, head_dim, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(total, num_heads, head_dim, generator=g).to(device=device, dtype=dtype)


def check(q, cache, bt, prefix, cu, masks, dtype, layout="flash_attn", **kwargs):
    got = tree_attention_triton(q, cache, bt, prefix, cu, masks, layout=layout, **kwargs)
    assert got.shape == q.shape and got.dtype == q.dtype
    scale = kwargs.get("sm_scale")
    want = tree_attention_reference(q.float(), cache.float(), bt, prefix, cu, masks, layout=layout, sm_scale=scale)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    if dtype != torch.float32:
        twin = tree_attention_reference(q, cache, bt, prefix, cu, masks, layout=layout, sm_scale=scale)
        torch.testing.assert_close(twin.float(), want, **TOL[dtype])
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree", ["single", "chain", "wide", "branchy", "deep64"])
def test_tree_shapes(tree, dtype, device):
    heads, kv_heads, head_dim = 4, 2, 64
    trees, prefixes = [TREES[tree]], [37]
    cache, bt, prefix, cu, masks = build_batch(trees, prefixes, kv_heads, head_dim, dtype, device)
    q = make_q(int(cu[-1]), heads, head_dim, dtype, device)
    check(q, cache, bt, prefix, cu, masks, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(2, 2, 64), (4, 1, 128), (8, 2, 128)])
def test_ragged_batch_gqa(heads, kv_heads, head_dim, dtype, device):
    trees = [TREES["branchy"], TREES["single"], TREES["chain"], TREES["wide"][:20]]
    prefixes = [0, 16, 45, 3]  # empty prefix, a whole block, ragged ends
    cache, bt, prefix, cu, masks = build_batch(trees, prefixes, kv_heads, head_dim, dtype, device)
    q = make_q(int(cu[-1]), heads, head_dim, dtype, device)
    check(q, cache, bt, prefix, cu, masks, dtype)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_prefix_splits(num_splits, device):
    """Flash-decoding splits of the prefix, including splits left with no key at all."""
    trees = [TREES["chain"], TREES["branchy"], TREES["single"]]
    prefixes = [150, 20, 0]
    cache, bt, prefix, cu, masks = build_batch(trees, prefixes, 1, 64, torch.float32, device)
    q = make_q(int(cu[-1]), 2, 64, torch.float32, device)
    one = check(q, cache, bt, prefix, cu, masks, torch.float32, num_splits=1)
    split = check(q, cache, bt, prefix, cu, masks, torch.float32, num_splits=num_splits)
    torch.testing.assert_close(split, one, atol=1e-5, rtol=1e-5)


def test_blocks_first_layout_strided_q_and_scale(device):
    trees, prefixes = [TREES["branchy"], TREES["chain"]], [21, 33]
    cache, bt, prefix, cu, masks = build_batch(trees, prefixes, 2, 64, torch.float32, device, layout="blocks_first")
    total = int(cu[-1])
    qkv = make_q(total, 3 * 4, 64, torch.float32, device)  # q is a strided slice of a fused qkv tensor
    q = qkv[:, :4]
    assert not q.is_contiguous()
    check(q, cache, bt, prefix, cu, masks, torch.float32, layout="blocks_first", sm_scale=0.2, max_tree_nodes=12)


def test_twin_is_brute_force_softmax(device):
    """The twin (SDPA with the ancestor mask) against an explicit loop over queries and keys."""
    trees, prefixes = [TREES["branchy"]], [5]
    cache, bt, prefix, cu, masks = build_batch(trees, prefixes, 1, 64, torch.float32, device)
    q = make_q(int(cu[-1]), 2, 64, torch.float32, device)
    out = tree_attention_reference(q, cache, bt, prefix, cu, masks)
    n, p = len(trees[0]), prefixes[0]
    slots = slot_mapping(bt[0].long(), torch.arange(p + n, device=device), BLOCK_SIZE)
    k = cache[0][slots // BLOCK_SIZE, slots % BLOCK_SIZE, 0]  # [P + n, d]
    v = cache[1][slots // BLOCK_SIZE, slots % BLOCK_SIZE, 0]
    allowed = torch.cat([torch.ones(n, p, dtype=torch.bool, device=device), ancestor_bits(masks, n)], dim=1)
    for i in range(n):
        for h in range(2):
            w = torch.softmax((k[allowed[i]] @ q[i, h]) / 8.0, dim=0)
            torch.testing.assert_close(out[i, h], w @ v[allowed[i]], atol=1e-5, rtol=1e-5)


def test_dispatch(device, monkeypatch):
    trees, prefixes = [TREES["chain"]], [9]
    cache, bt, prefix, cu, masks = build_batch(trees, prefixes, 1, 64, torch.float32, device)
    q = make_q(int(cu[-1]), 2, 64, torch.float32, device)
    want = tree_attention_reference(q, cache, bt, prefix, cu, masks)
    monkeypatch.setenv("VLLM_MOA_KERNELS", "torch")
    torch.testing.assert_close(tree_attention_paged(q, cache, bt, prefix, cu, masks), want, rtol=0, atol=0)
    monkeypatch.setenv("VLLM_MOA_KERNELS", "triton")
    got = tree_attention_paged(q, cache, bt, prefix, cu, masks)
    torch.testing.assert_close(got, tree_attention_triton(q, cache, bt, prefix, cu, masks), rtol=0, atol=0)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    got = tree_attention_paged(q, cache, bt, prefix, cu, masks, backend="torch")
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rejects_bad_inputs(device):
    trees, prefixes = [TREES["chain"]], [9]
    cache, bt, prefix, cu, masks = build_batch(trees, prefixes, 2, 64, torch.float32, device)
    q = make_q(int(cu[-1]), 3, 64, torch.float32, device)
    with pytest.raises(ValueError, match="does not fit"):
        tree_attention_triton(q, cache, bt, prefix, cu, masks)
    with pytest.raises(ValueError, match="dtype"):
        tree_attention_triton(make_q(int(cu[-1]), 2, 64, torch.bfloat16, device), cache, bt, prefix, cu, masks)
    with pytest.raises(ValueError, match="at most 64"):
        tree_attention_triton(make_q(int(cu[-1]), 2, 64, torch.float32, device), cache, bt, prefix, cu, masks,
                              max_tree_nodes=65)
