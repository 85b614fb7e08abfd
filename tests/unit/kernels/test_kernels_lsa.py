"""LSA from paged caches: Triton kernels against their PyTorch twins and against the
`LayerSelfAttention` module on rows gathered by the twin.

Tolerances (outputs are O(1): weights are scaled by 1/sqrt(fan-in)):
* fp32: 1e-4 absolute (+1e-4 relative): the kernels do the same maths in fp32.
* bf16: 2e-2 absolute (+2e-2 relative) against an fp32 evaluation of the same bf16 inputs and
  weights: the kernels accumulate in fp32 and round once per stage; the bf16 twin itself lands
  within the same bound.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from vllm_moa.config import TargetSignature  # noqa: E402
from vllm_moa.kernels import (  # noqa: E402
    PagedLayers,
    gather_layer_rows,
    lsa_attention,
    lsa_attention_reference,
    lsa_rows_from_paged,
    new_kv_cache,
    split_kv_cache,
)
from vllm_moa.kernels.lsa import (  # noqa: E402
    fused_qkv_weight,
    lsa_layer_attention,
    lsa_layer_attention_reference,
    lsa_qkv_paged,
    lsa_qkv_reference,
)
from vllm_moa.kinds.moa import MoAConfig  # noqa: E402
from vllm_moa.kinds.moa.model import LayerSelfAttention  # noqa: E402

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
BLOCK_SIZE = 16
NUM_BLOCKS = 11
# token slots spread over non-contiguous blocks, out of order, first/last offsets included
SLOTS = [5 * 16 + 3, 0, 9 * 16 + 15, 2 * 16 + 7, 9 * 16 + 1, 7 * 16 + 8]


def make_lsa(num_layers: int, num_kv_heads: int, head_dim: int, lsa_heads: int, dtype, device,
             intermediate: int = 96, seed: int = 0) -> LayerSelfAttention:
    sig = TargetSignature("LlamaForCausalLM", num_layers, 64, 4, num_kv_heads, head_dim, 101)
    config = MoAConfig(target=sig, lsa_num_heads=lsa_heads, lsa_intermediate_size=intermediate)
    torch.manual_seed(seed)
    lsa = LayerSelfAttention(config)
    with torch.no_grad():
        for p in lsa.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)  # norm weights
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return lsa.to(device=device, dtype=dtype).eval()


def make_caches(num_layers, num_kv_heads, head_dim, dtype, device, layout="flash_attn", seed=1):
    g = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(num_layers):
        cache = new_kv_cache(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, layout=layout)
        cache.copy_(torch.randn(cache.shape, generator=g))
        caches.append(cache.to(device=device, dtype=dtype))
    return caches


def fp32_truth(lsa, caches, slots):
    """The module in fp32 on the rows of `slots` (from bf16-rounded caches and weights)."""
    import copy

    ref = copy.deepcopy(lsa).float()
    with torch.no_grad():
        return ref(gather_layer_rows([c.float() for c in caches], slots))


# ---------------------------------------------------------------------------------------------
# stage 1: gather + RMSNorm + qkv projection
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_layers, num_kv_heads, head_dim", [(1, 2, 64), (7, 1, 128), (33, 2, 64), (7, 3, 64)])
def test_qkv_kernel_matches_twin(num_layers, num_kv_heads, head_dim, dtype, device):
    lsa = make_lsa(num_layers, num_kv_heads, head_dim, 4, dtype, device)
    caches = make_caches(num_layers, num_kv_heads, head_dim, dtype, device)
    slots = torch.tensor(SLOTS, device=device)
    wqkv = fused_qkv_weight(lsa)
    eps = lsa.input_norm.eps
    got = lsa_qkv_paged(PagedLayers.from_caches(caches), slots, lsa.input_norm.weight, eps, wqkv)
    rows = gather_layer_rows([c.float() for c in caches], slots).reshape(-1, 2 * num_kv_heads * head_dim)
    want = lsa_qkv_reference(rows, lsa.input_norm.weight.float(), eps, wqkv.float())
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


# ---------------------------------------------------------------------------------------------
# stage 2: attention over the layer axis, RoPE at the layer index
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_layers, width, heads", [(1, 256, 4), (7, 256, 2), (33, 256, 8), (33, 384, 4)])
def test_layer_attention_kernel_matches_twin(num_layers, width, heads, dtype, device):
    g = torch.Generator().manual_seed(3)
    n = 3
    qkv = torch.randn(n, num_layers, 3 * width, generator=g).to(device=device, dtype=dtype)
    e = width // heads
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, e, 2, dtype=torch.float32) / e))
    got = lsa_layer_attention(qkv.view(n * num_layers, 3 * width), num_layers, heads, inv_freq.to(device))
    want = lsa_layer_attention_reference(qkv.float(), heads, inv_freq.to(device))
    torch.testing.assert_close(got.view(n, num_layers, width).float(), want, **TOL[dtype])


# ---------------------------------------------------------------------------------------------
# the whole LSA against vllm_moa.kinds.moa.model.LayerSelfAttention
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_layers, num_kv_heads, head_dim, lsa_heads", [
    (1, 2, 64, 4),
    (7, 1, 128, 2),
    (7, 2, 64, 8),
    (33, 1, 64, 2),
    (33, 2, 128, 4),
    (3, 1, 80, 2),  # head_dim 80: 16-wide column chunks
    (3, 1, 72, 2),  # head_dim 72: no chunk size divides it, per-column addressing
])
def test_lsa_rows_from_paged_matches_module(num_layers, num_kv_heads, head_dim, lsa_heads, dtype, device):
    lsa = make_lsa(num_layers, num_kv_heads, head_dim, lsa_heads, dtype, device)
    caches = make_caches(num_layers, num_kv_heads, head_dim, dtype, device)
    slots = torch.tensor(SLOTS, device=device)
    got = lsa_rows_from_paged(lsa, caches, slots)
    assert got.shape == (len(SLOTS), 64) and got.dtype == dtype
    with torch.no_grad():  # both in inference mode: the module's CPU linears are then packed (packed_linear.py)
        module_out = lsa(gather_layer_rows(caches, slots))  # the module on rows gathered by the twin
        twin = lsa_attention_reference(lsa, caches, slots)
    torch.testing.assert_close(twin, module_out, rtol=0, atol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(got, module_out, **TOL[dtype])
    else:
        truth = fp32_truth(lsa, caches, slots)
        torch.testing.assert_close(got.float(), truth, **TOL[dtype])
        torch.testing.assert_close(module_out.float(), truth, **TOL[dtype])


@pytest.mark.parametrize("layout", ["blocks_first", "hnd_strides", "stacked"])
def test_lsa_layouts(layout, device):
    num_layers, num_kv_heads, head_dim = 5, 2, 64
    lsa = make_lsa(num_layers, num_kv_heads, head_dim, 4, torch.float32, device)
    slots = torch.tensor(SLOTS, device=device)
    if layout == "blocks_first":
        name = "blocks_first"
        caches = make_caches(num_layers, num_kv_heads, head_dim, torch.float32, device, name)
    elif layout == "hnd_strides":
        # physically [2, blocks, heads, block_size, d], viewed in the logical flash_attn shape
        dense = make_caches(num_layers, num_kv_heads, head_dim, torch.float32, device)
        caches = []
        for c in dense:
            phys = c.permute(0, 1, 3, 2, 4).contiguous()
            caches.append(phys.permute(0, 1, 3, 2, 4))
        name = "flash_attn"
        assert not caches[0].is_contiguous()
    else:
        caches, name = torch.stack(make_caches(num_layers, num_kv_heads, head_dim, torch.float32, device)), "flash_attn"
    want = lsa_attention_reference(lsa, caches, slots, layout=name)
    got = lsa_rows_from_paged(lsa, caches, slots, layout=name)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_lsa_custom_layout_callable(device):
    """A layout given as a callable returning strided K/V views (e.g. another backend's)."""
    num_layers, num_kv_heads, head_dim = 3, 1, 64
    lsa = make_lsa(num_layers, num_kv_heads, head_dim, 2, torch.float32, device)
    flash = make_caches(num_layers, num_kv_heads, head_dim, torch.float32, device)
    # [num_blocks, H_kv, 2 * block_size, d]: K rows first, then V rows (a CPU-backend-like layout)
    custom = [torch.cat([c[0].transpose(1, 2), c[1].transpose(1, 2)], dim=2).contiguous() for c in flash]

    def layout(cache):
        k, v = cache.chunk(2, dim=2)
        return k.transpose(1, 2), v.transpose(1, 2)

    slots = torch.tensor(SLOTS, device=device)
    want = lsa_attention_reference(lsa, flash, slots)
    got = lsa_rows_from_paged(lsa, custom, slots, layout=layout)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert split_kv_cache(custom[0], layout)[0].shape == (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)


def test_lsa_chunks_empty_and_dispatch(device, monkeypatch):
    num_layers, num_kv_heads, head_dim = 3, 1, 64
    lsa = make_lsa(num_layers, num_kv_heads, head_dim, 2, torch.float32, device)
    caches = make_caches(num_layers, num_kv_heads, head_dim, torch.float32, device)
    slots = torch.tensor(SLOTS, device=device)
    whole = lsa_rows_from_paged(lsa, caches, slots, chunk_tokens=None)
    # chunks change only the GEMM shapes torch sees (rounding-level differences)
    torch.testing.assert_close(lsa_rows_from_paged(lsa, caches, slots, chunk_tokens=4), whole, atol=1e-5, rtol=1e-5)
    empty = lsa_rows_from_paged(lsa, caches, slots[:0])
    assert empty.shape == (0, 64)
    assert lsa_attention_reference(lsa, caches, slots[:0]).shape == (0, 64)
    # the switch
    monkeypatch.setenv("VLLM_MOA_KERNELS", "torch")
    torch.testing.assert_close(lsa_attention(lsa, caches, slots), lsa_attention_reference(lsa, caches, slots),
                               rtol=0, atol=0)
    monkeypatch.setenv("VLLM_MOA_KERNELS", "triton")
    torch.testing.assert_close(lsa_attention(lsa, caches, slots), whole, rtol=0, atol=0)


def test_fused_qkv_weight_follows_updates(device):
    lsa = make_lsa(2, 1, 64, 2, torch.float32, device)
    first = fused_qkv_weight(lsa)
    assert fused_qkv_weight(lsa) is first
    with torch.no_grad():
        lsa.attn.k_proj.weight.mul_(2.0)
    second = fused_qkv_weight(lsa)
    torch.testing.assert_close(second[128:256], lsa.attn.k_proj.weight, rtol=0, atol=0)


def test_lsa_refuses_width_and_dtype_mismatch(device):
    lsa = make_lsa(2, 1, 64, 2, torch.float32, device)
    slots = torch.tensor(SLOTS, device=device)
    with pytest.raises(ValueError, match="row width"):
        lsa_rows_from_paged(lsa, make_caches(2, 2, 64, torch.float32, device), slots)
    with pytest.raises(ValueError, match="dtype"):
        lsa_rows_from_paged(lsa, make_caches(2, 1, 64, torch.bfloat16, device), slots)
