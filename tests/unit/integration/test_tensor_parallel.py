"""The head arithmetic of MoA on tensor-parallel targets (integration/shell/tp_layout.py, integration/moa/tensor_parallel.py), without
vLLM: which heads a rank holds, which setups are refused, and how the tap's all-gather turns every
rank's slice back into LSA's full row. The engine runs at TP = 2 and 3 are in
tests/integration/vllm/test_vllm_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch

from vllm_moa.integration.moa.tensor_parallel import TapTraffic, pack_fp8, unique_kv_head_rows, unpack_fp8
from vllm_moa.integration.shell.tp_layout import (
    cpu_thread_binding,
    local_heads,
    local_kv_heads,
    tensor_parallel_refusal,
    tp_options,
)
from vllm_moa.kernels.paged import gather_layer_rows, new_kv_cache, write_slots


def test_heads_per_rank():
    assert local_heads(9, 3, "x") == 3 and local_kv_heads(3, 3) == 1 and local_kv_heads(2, 2) == 1
    assert local_kv_heads(2, 4) == 1  # replicated: 2 ranks per head
    with pytest.raises(ValueError, match="9 heads do not split across tensor_parallel_size=2"):
        local_heads(9, 2, "x")
    with pytest.raises(ValueError, match="KV heads: tensor_parallel_size=3 is not a multiple of the 2 heads"):
        local_kv_heads(2, 3)


def test_refusals_name_the_part_that_does_not_split():
    ok = {"sa_heads": 9, "sa_kv_heads": 3, "ca_heads": 9, "ca_kv_heads": 3, "target_kv_heads": 3}
    assert tensor_parallel_refusal(3, **ok) is None  # SmolLM2's drafter at TP = 3
    assert "the drafter's CA KV heads" in tensor_parallel_refusal(6, **{**ok, "sa_heads": 18, "ca_heads": 18})
    assert tensor_parallel_refusal(6, **{**ok, "sa_heads": 18, "ca_heads": 18, "ca_kv_heads": 6}) is None
    assert "the target's KV heads" in tensor_parallel_refusal(
        6, **{**ok, "sa_heads": 18, "ca_heads": 18, "ca_kv_heads": 6, "target_kv_heads": 4})


def _tp_slices(rows: torch.Tensor, tp: int, kv_heads: int) -> list[torch.Tensor]:
    """What each of `tp` ranks holds of full rows [M, L, H_kv, 2d] (vLLM's layout: contiguous
    head ranges; rank r holds head r // (tp / H_kv) when heads are replicated)."""
    if tp <= kv_heads:
        return list(rows.chunk(tp, dim=2))
    replicas = tp // kv_heads
    return [rows[:, :, r // replicas: r // replicas + 1] for r in range(tp)]


@pytest.mark.parametrize("tp,kv_heads", [(1, 3), (3, 3), (2, 2), (4, 2), (6, 3), (2, 4)])
def test_gathered_slices_give_back_the_full_row(tp, kv_heads):
    torch.manual_seed(0)
    layers, heads_dim, tokens = 5, 8, 7
    caches = [new_kv_cache(4, 4, kv_heads, heads_dim // 2, dtype=torch.float32) for _ in range(layers)]
    slots = torch.tensor([0, 3, 5, 6, 9, 12, 15])
    for cache in caches:
        write_slots(cache, slots, torch.randn(tokens, kv_heads, heads_dim // 2), torch.randn(tokens, kv_heads, heads_dim // 2))
    full = gather_layer_rows(caches, slots)  # [M, L, H_kv * 2d]: what LSA reads on one device
    per_head = full.view(tokens, layers, kv_heads, heads_dim)
    gathered = torch.cat([s.flatten(2) for s in _tp_slices(per_head, tp, kv_heads)], dim=-1)  # all-gather, dim -1
    assert torch.equal(unique_kv_head_rows(gathered, tp, kv_heads), full)


def test_traffic_counts_what_a_rank_sends():
    traffic = TapTraffic(tp_size=3)
    traffic.record(target_tokens=8, gathered_tokens=4, nbytes=100)
    traffic.record(target_tokens=4, gathered_tokens=2, nbytes=50)
    assert (traffic.steps, traffic.target_tokens, traffic.gathered_tokens, traffic.bytes_contributed,
            traffic.bytes_sent) == (2, 12, 6, 150, 300)
    assert traffic.by_step == [(8, 4, 100), (4, 2, 50)]
    for _ in range(TapTraffic.STEPS_KEPT):
        traffic.record(target_tokens=1, gathered_tokens=1, nbytes=1)
    assert len(traffic.by_step) == TapTraffic.STEPS_KEPT and traffic.by_step[0] == (1, 1, 1)


def test_token_checksum_tells_ranks_that_verify_other_tokens_apart():
    one, other = TapTraffic(), TapTraffic()
    one.add_tokens(torch.tensor([5, 7]), torch.tensor([10, 11]))
    other.add_tokens(torch.tensor([5, 7]), torch.tensor([10, 11]))
    assert one.token_checksum == other.token_checksum == 6 * 11 + 8 * 12
    other.add_tokens(torch.tensor([9]), torch.tensor([12]))
    one.add_tokens(torch.tensor([8]), torch.tensor([12]))
    assert one.token_checksum != other.token_checksum


def test_cpu_thread_binding():
    assert cpu_thread_binding(1, [0, 1]) == "0-1"
    assert cpu_thread_binding(3, [0, 1]) == "0|1|0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_tap_rows_round_each_vector_to_float8_with_its_own_scale(dtype):
    """VLLM_MOA_TP_TAP_DTYPE=fp8: [A, L, H * 2d] rows packed to 1 byte per value + one float32 scale
    per (token, layer, head, K or V), in the rows' own dtype (what the all-gather moves), and
    unpacked within float8 e4m3's rounding: 1/16 of a value, and a sliver of its vector's maximum
    below e4m3's normal range. Rows of very different magnitudes keep their own precision, and a
    zero vector stays zero."""
    torch.manual_seed(0)
    d = 64
    rows = torch.randn(5, 7, 3 * 2 * d) * torch.logspace(-3, 3, 6 * 5 * 7).view(5, 7, 6).repeat_interleave(d, -1)
    rows[0, 0, :d] = 0
    rows = rows.to(dtype)
    packed = pack_fp8(rows, d)
    assert packed.dtype == dtype and packed.shape[:2] == (5, 7)
    assert packed.numel() * packed.element_size() == 5 * 7 * (6 * d + 6 * 4)  # codes + scales, no padding here
    back = unpack_fp8(packed, 6, d, dtype).float()
    exact = rows.float()
    vector_max = exact.unflatten(-1, (6, d)).abs().amax(-1).repeat_interleave(d, -1)
    assert ((back - exact).abs() <= exact.abs() / 16 + vector_max * 1e-5).all()
    assert (back[0, 0, :d] == 0).all()
    assert (back - exact).abs().max() > 0  # rounded: the test can tell


def test_fp8_unpacks_every_ranks_chunk_after_a_gather():
    """The all-gather concatenates each rank's packed chunk; unpacking them as [t, m] gives the
    rows of the ranks in order, as the gather of the raw rows would."""
    d = 8
    ranks = [torch.randn(2, 3, 2 * 2 * d) for _ in range(3)]
    gathered = torch.cat([pack_fp8(r, d) for r in ranks], dim=-1).unflatten(-1, (3, -1))
    back = unpack_fp8(gathered, 4, d, torch.float32).flatten(-2)
    assert torch.allclose(back, torch.cat(ranks, dim=-1), rtol=1 / 16, atol=1e-3)


def test_tp_options_refuse_unknown_values(monkeypatch):
    assert tp_options() == ("sharded", "auto")
    monkeypatch.setenv("VLLM_MOA_TP_DRAFTER_MLP", "Replicated")
    monkeypatch.setenv("VLLM_MOA_TP_TAP_DTYPE", "fp8")
    assert tp_options() == ("replicated", "fp8")
    monkeypatch.setenv("VLLM_MOA_TP_TAP_DTYPE", "int4")
    with pytest.raises(ValueError, match=r"VLLM_MOA_TP_TAP_DTYPE='int4': expected one of \['auto', 'fp8'\]"):
        tp_options()
    monkeypatch.setenv("VLLM_MOA_TP_TAP_DTYPE", "fp8")
    monkeypatch.setenv("VLLM_MOA_TP_DRAFTER_MLP", "halved")
    with pytest.raises(ValueError, match="VLLM_MOA_TP_DRAFTER_MLP='halved'"):
        tp_options()
