"""The drafters' building blocks take faster paths in CPU inference (layers.py): a cos/sin table
for RoPE, fused projections. Each must give what the plain computation gives."""

import torch

from vllm_moa.layers import AttentionProjections, RotaryEmbedding, SwiGLU


def test_rope_table_lookup_equals_the_computation_as_the_table_grows():
    rotary = RotaryEmbedding(64, theta=10000.0)
    for positions in (torch.tensor([[0, 5, 17]]), torch.tensor([3000, 1023, 1024]), torch.tensor([[40000]])):
        with torch.no_grad():
            cos, sin = rotary(positions)  # table (grown to cover the largest position)
        with torch.enable_grad():
            want_cos, want_sin = rotary(positions)  # computed
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert rotary._table[0].shape[0] == 40960  # grown in whole steps, kept


def test_fused_projections_equal_the_separate_ones():
    torch.manual_seed(0)
    attn = AttentionProjections(576, 576, 9, 3, 64)  # SmolLM2-sized: the fused matmul is packed
    mlp = SwiGLU(576, 1024)
    x = torch.randn(2, 5, 576)
    with torch.no_grad():
        q, k, v = attn.queries_keys_values(x)
        kv = attn.keys_values(x)
        out = mlp(x)
    with torch.enable_grad():  # the plain path: each projection on its own
        want_q, want_k, want_v = attn.queries(x), *attn.keys_values(x)
        want = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    for got, ref in ((q, want_q), (k, want_k), (v, want_v), (kv[0], want_k), (kv[1], want_v), (out, want)):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref.detach(), rtol=1e-4, atol=1e-4)
