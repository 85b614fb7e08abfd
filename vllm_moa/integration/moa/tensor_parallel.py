"""MoA on a tensor-parallel target (docs/sharded-targets.md): what each rank holds, and the one
collective the tap adds.

Under tensor parallelism t, vLLM gives rank r the KV heads r*H_kv/t ... of every target layer
(each head replicated on t/H_kv ranks when t > H_kv). Layer Self-Attention reads a token's full
row, every KV head of every tapped layer, so the tap gathers the verified tokens' head slices from
all ranks (one all-gather per step, rows of accepted tokens only) and runs LSA replicated; SA and
CA are vLLM parallel layers, sharded by heads like the target's attention (the drafter's tensor
parallel size is the target's). A reduced draft vocabulary needs its LM-head rows, which vLLM
shards by vocabulary: they are assembled once by an all-reduce.

Two options trade a little for fewer bytes (docs/sharded-targets.md has the model):
VLLM_MOA_TP_DRAFTER_MLP=replicated keeps the drafter's MLPs whole on every rank (no all-reduce
after them), and VLLM_MOA_TP_TAP_DTYPE=fp8 gathers the tap's rows as float8 e4m3, one scale per
token, layer, KV head and K/V (`pack_fp8` / `unpack_fp8`: 1/2 of bf16's bytes, 1/4 of fp32's; the
drafter then reads rounded rows, so its drafts may change a little, never the output).

The pure functions here (head arithmetic, de-replication, the fp8 packing) take the sizes as
arguments and are tested without vLLM; the collectives are vLLM's own (vllm.distributed).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from vllm_moa.integration.shell.tp_layout import tp_options, tp_size

FP8_MAX = 448.0  # float8 e4m3's largest finite value


def pack_fp8(rows: Tensor, head_dim: int) -> Tensor:
    """rows [..., n * d] (n vectors of d: each KV head's K, then its V) -> [..., m] in rows' dtype:
    the vectors as float8 e4m3 codes, each scaled by its own absolute maximum, then their n float32
    scales, as bits (reinterpreted, not converted: any collective that copies moves them intact)."""
    vectors = rows.float().unflatten(-1, (-1, head_dim))  # [..., n, d]
    scales = vectors.abs().amax(-1) / FP8_MAX  # [..., n]
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    codes = (vectors / divisor).to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2)  # [..., n * d]
    packed = torch.cat([codes, scales.contiguous().view(torch.uint8)], dim=-1)  # [..., n * d + 4n] bytes
    pad = -packed.shape[-1] % rows.element_size()
    if pad:
        packed = torch.cat([packed, packed.new_zeros(*packed.shape[:-1], pad)], dim=-1)
    return packed.view(rows.dtype)


def unpack_fp8(packed: Tensor, vectors: int, head_dim: int, dtype: torch.dtype) -> Tensor:
    """pack_fp8's inverse: [..., m] -> [..., vectors * head_dim] in `dtype` (the rounded rows)."""
    raw = packed.contiguous().view(torch.uint8)
    width = vectors * head_dim
    codes = raw[..., :width].view(torch.float8_e4m3fn).float().unflatten(-1, (vectors, head_dim))
    scales = raw[..., width: width + 4 * vectors].contiguous().view(torch.float32)  # [..., vectors]
    return (codes * scales.unsqueeze(-1)).flatten(-2).to(dtype)


def unique_kv_head_rows(gathered: Tensor, tp_size: int, total_kv_heads: int) -> Tensor:
    """Rows gathered from every rank, [..., tp_size * w] (rank order; w = one rank's heads x 2d) ->
    [..., total_kv_heads * 2d]: when heads are replicated (tp_size > total_kv_heads), keep one copy
    of each (rank r holds head r // (tp_size / total_kv_heads))."""
    if tp_size <= total_kv_heads:
        return gathered
    replicas = tp_size // total_kv_heads
    per_rank = gathered.view(*gathered.shape[:-1], tp_size, gathered.shape[-1] // tp_size)
    return per_rank[..., ::replicas, :].flatten(-2)


@dataclass
class TapTraffic:
    """What the tap's all-gather moved on this rank: steps, the tokens the target processed in them
    and the verified ones gathered, and the bytes this rank contributed (a ring all-gather sends
    (t - 1) times that). Read by the benchmark through vLLM's collective_rpc (worker_tap_traffic)."""

    tp_size: int = 1
    steps: int = 0  # all-gathers (one per step with verified tokens)
    target_tokens: int = 0  # tokens the target ran in those steps (verified or not)
    gathered_tokens: int = 0  # verified tokens whose rows were gathered
    bytes_contributed: int = 0
    # the last STEPS_KEPT steps as (target tokens, gathered tokens, bytes contributed): benchmarks
    # tell prefill steps from speculative ones by their token counts
    by_step: list[tuple[int, int, int]] = field(default_factory=list)

    # sum over the verified tokens of (token id + 1) * (position + 1), mod 2**61 - 1: equal on
    # every rank while the ranks verify the same tokens (tests compare it across ranks)
    token_checksum: int = 0

    STEPS_KEPT: ClassVar[int] = 4096
    CHECKSUM_MODULUS: ClassVar[int] = (1 << 61) - 1

    def add_tokens(self, token_ids: Tensor, positions: Tensor) -> None:
        """Fold the step's verified tokens [A] at positions [A] into token_checksum."""
        step = int(((token_ids.long() + 1) * (positions.long() + 1)).sum())
        self.token_checksum = (self.token_checksum + step) % self.CHECKSUM_MODULUS

    def record(self, target_tokens: int, gathered_tokens: int, nbytes: int) -> None:
        self.steps += 1
        self.target_tokens += target_tokens
        self.gathered_tokens += gathered_tokens
        self.bytes_contributed += nbytes
        self.by_step = [*self.by_step[1 - self.STEPS_KEPT:], (target_tokens, gathered_tokens, nbytes)]

    @property
    def bytes_sent(self) -> int:
        """Bytes a ring all-gather sends from this rank."""
        return self.bytes_contributed * (self.tp_size - 1)


def worker_tap_traffic(worker: Any) -> dict[str, Any]:
    """For vLLM's collective_rpc: this worker's TapTraffic and rank ({} without a MoA drafter)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    if not hasattr(drafter, "moa_model"):
        return {}
    traffic = drafter.moa_model().tap_traffic
    mlp, tap = tp_options()
    return {"rank": get_tensor_model_parallel_rank(), **asdict(traffic), "bytes_sent": traffic.bytes_sent,
            "drafter_mlp": mlp, "tap_dtype": tap}


def gather_full_rows(local: Tensor, total_kv_heads: int, traffic: TapTraffic, step_tokens: int,
                     head_dim: int, fp8: bool = False) -> Tensor:
    """local [A, L, H_local * 2d] (this rank's KV heads of each tapped layer, for the A verified
    tokens of a step of `step_tokens`) -> [A, L, H_kv * 2d], every rank's heads in head order
    (kernels.paged.gather_layer_rows' layout); as float8 codes and scales with `fp8`
    (VLLM_MOA_TP_TAP_DTYPE=fp8, read once by the model; one collective either way)."""
    from vllm.distributed import tensor_model_parallel_all_gather

    size = tp_size()
    if size == 1:
        return local
    traffic.tp_size = size
    sent = pack_fp8(local, head_dim) if fp8 else local.contiguous()  # [A, L, m]
    traffic.record(step_tokens, local.shape[0], sent.numel() * sent.element_size())
    gathered = tensor_model_parallel_all_gather(sent, dim=-1)  # [A, L, t * m]
    if fp8:
        per_rank = gathered.unflatten(-1, (size, -1))  # [A, L, t, m]
        gathered = unpack_fp8(per_rank, local.shape[-1] // head_dim, head_dim, local.dtype).flatten(-2)
    return unique_kv_head_rows(gathered, size, total_kv_heads)


def vocab_rows(lm_head: torch.nn.Module, ids: Tensor) -> Tensor:
    """The LM head's rows of target token `ids` [N] -> [N, E], whole on every rank (vLLM shards
    the head by vocabulary: each rank fills the rows it holds, one all-reduce sums them)."""
    weight = lm_head.weight
    size = tp_size()
    if size == 1:
        return weight.index_select(0, ids)
    from vllm.distributed import tensor_model_parallel_all_reduce

    shard = lm_head.shard_indices
    start, end = shard.org_vocab_start_index, shard.org_vocab_end_index
    mine = (ids >= start) & (ids < end)
    rows = weight.new_zeros(ids.shape[0], weight.shape[1])
    rows[mine] = weight.index_select(0, ids[mine] - start)
    return tensor_model_parallel_all_reduce(rows)
