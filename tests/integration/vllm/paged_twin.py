"""A PyTorch twin of a vLLM 0.26 paged attention layer, for running the vLLM-native MoA model on
CPU (vLLM's CUDA wheel has no CPU attention kernels).

Same contract as `vllm.model_executor.layers.attention.Attention` as MoADraftModel uses it:
constructor (num_heads, head_size, scale, num_kv_heads=, cache_config=, prefix=,
per_layer_sliding_window=), call
`attn(q [T, H*d], k [T, H_kv*d], v) -> [T, H*d]`, `.kv_cache` (packed layout
[num_blocks, H_kv, block_size, 2d]) and `.impl.do_kv_cache_update(layer, k, v, kv_cache, slots)`.
Semantics are FlashAttention's varlen paged attention: the layer's K/V are first written at its
slot mapping (slots < 0 skipped; no mapping = no write), then request b's query i (of q_b) sees
keys at positions 0 .. seq_len_b - q_b + i through its block table (causal), or all
seq_len_b of them (non-causal); with a sliding window W, none before seq_len_b - q_b + i - W + 1
(causal or not: what vLLM's CPU kernel and FlashAttention's window (W - 1, 0) do).

The metadata comes from a `PagedContext` the test fills before each forward, as vLLM's forward
context would (attn_metadata and slot_mapping per layer name).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vllm_moa.integration.shell.compat import packed_kv_layout
from vllm_moa.kernels.paged import write_slots


@dataclass
class PagedMetadata:
    query_start_loc: Tensor  # [B + 1]
    seq_lens: Tensor  # [B]
    block_table: Tensor  # [B, max_blocks]
    causal: bool = True
    seq_lens_cpu_upper_bound: Tensor | None = None  # as vLLM 0.32's CommonAttentionMetadata

    def replace(self, **changes) -> PagedMetadata:
        return dataclasses.replace(self, **changes)


@dataclass
class PagedContext:
    metadata: dict[str, PagedMetadata] = field(default_factory=dict)
    slot_mapping: dict[str, Tensor] = field(default_factory=dict)


def new_packed_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                     generator: torch.Generator) -> Tensor:
    """A cache as vLLM 0.26 allocates it (NHD physical order, logical [nb, H, bs, 2d]), filled
    with noise so that reading an unwritten slot cannot go unnoticed."""
    physical = torch.randn(num_blocks, block_size, num_kv_heads, 2 * head_dim, generator=generator)
    return physical.permute(0, 2, 1, 3)


class _Impl:
    @staticmethod
    def do_kv_cache_update(layer: nn.Module, key: Tensor, value: Tensor, kv_cache: Tensor, slots: Tensor) -> None:
        keep = slots >= 0
        write_slots(kv_cache, slots[keep], key.reshape(-1, layer.num_kv_heads, layer.head_size)[keep],
                    value.reshape(-1, layer.num_kv_heads, layer.head_size)[keep], layout=packed_kv_layout)


class TwinAttention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 cache_config=None, prefix: str = "", per_layer_sliding_window: int | None = None, *,
                 context: PagedContext) -> None:
        super().__init__()
        self.sliding_window = per_layer_sliding_window
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.layer_name = prefix
        self.context = context
        self.impl = _Impl()
        self.kv_cache = torch.empty(0)

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        slots = self.context.slot_mapping.get(self.layer_name)
        if slots is not None:
            self.impl.do_kv_cache_update(self, key, value, self.kv_cache, slots)
        md = self.context.metadata[self.layer_name]
        k_cache, v_cache = packed_kv_layout(self.kv_cache)  # [nb, bs, H_kv, d]
        block_size = k_cache.shape[1]
        q = query.view(-1, self.num_heads, self.head_size)
        out = torch.zeros_like(q)
        starts = md.query_start_loc.tolist()
        for b, seq_len in enumerate(md.seq_lens.tolist()):
            lo, hi = starts[b], starts[b + 1]
            if hi == lo:
                continue
            pos = torch.arange(seq_len)
            slot = md.block_table[b, pos // block_size].long() * block_size + pos % block_size
            k = k_cache[slot // block_size, slot % block_size].transpose(0, 1)  # [H_kv, S, d]
            v = v_cache[slot // block_size, slot % block_size].transpose(0, 1)
            groups = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
            qb = q[lo:hi].transpose(0, 1)  # [H, q, d]
            q_len = hi - lo
            aligned = (seq_len - q_len + torch.arange(q_len))[:, None]  # each query's last key
            visible = torch.arange(seq_len)[None, :] <= aligned
            if not md.causal:
                visible = torch.ones_like(visible)
            if self.sliding_window:
                visible &= torch.arange(seq_len)[None, :] > aligned - self.sliding_window
            out[lo:hi] = F.scaled_dot_product_attention(qb, k, v, attn_mask=visible, scale=self.scale).transpose(0, 1)
        return out.reshape(query.shape[0], -1)
