"""Building blocks shared by the drafters: RMSNorm, rotary embedding, masked attention, SwiGLU.

Masks everywhere are boolean with True = "may attend", broadcastable to [B, H, T_q, T_k].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vllm_moa.packed_linear import Linear, linear


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Plain (unscaled) RoPE, rotate-half convention, as in Llama."""

    TABLE_STEP = 1024  # inference reads cos/sin from a table grown in steps of this many positions

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._table: tuple[Tensor, Tensor] | None = None  # cos, sin [P, head_dim] fp32 (inference)

    def forward(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """positions [...] -> cos, sin [..., head_dim]"""
        if (not torch.is_grad_enabled() and positions.device.type == "cpu" and positions.numel() <= 64
                and not torch.compiler.is_compiling()):
            # drafting: a table lookup (the same values: the same ops on the same positions)
            cos, sin = self._lookup_table(positions)
            return cos.to(dtype), sin.to(dtype)
        return self._compute(positions, dtype)

    def _compute(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _lookup_table(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        top = int(positions.max()) + 1 if positions.numel() else 0
        if self._table is None or self._table[0].shape[0] < top or self._table[0].device != positions.device:
            size = -(-max(top, 1) // self.TABLE_STEP) * self.TABLE_STEP
            self._table = self._compute(torch.arange(size, device=positions.device), torch.float32)
        cos, sin = self._table
        return cos[positions], sin[positions]


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, d], cos/sin [B, T, d] (or [T, d]) -> x rotated at its positions."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Scaled dot-product attention with grouped KV heads.

    q [B, H, T_q, d], k/v [B, H_kv, T_k, d], mask bool broadcastable to [B, H, T_q, T_k]
    (True = may attend; every query row must allow at least one key) -> [B, H, T_q, d]
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and q.device.type == "cpu" and not (torch.is_grad_enabled() and q.requires_grad):
        # CPU inference: SDPA reads the shared KV heads in place (the same result, 2-4x faster at
        # drafting sizes). Training and GPUs keep the copy they were measured with.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class SwiGLU(nn.Module):
    def __init__(self, width: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(width, intermediate, bias=False)
        self.up_proj = Linear(width, intermediate, bias=False)
        self.down_proj = Linear(intermediate, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = linear(x, self.gate_proj, self.up_proj)  # one fused matmul in CPU inference
        return self.down_proj(F.silu(gate) * up)


class AttentionProjections(nn.Module):
    """q/k/v/o projections of one attention; queries and keys/values may come from different
    inputs (self- or cross-attention), each of its own width."""

    def __init__(self, query_width: int, kv_width: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, out_width: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(query_width, num_heads * head_dim, bias=False)
        self.k_proj = Linear(kv_width, num_kv_heads * head_dim, bias=False)
        self.v_proj = Linear(kv_width, num_kv_heads * head_dim, bias=False)
        self.o_proj = Linear(num_heads * head_dim, out_width or query_width, bias=False)

    def queries(self, x: Tensor) -> Tensor:
        """[B, T, W] -> [B, H, T, d]"""
        b, t, _ = x.shape
        return self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

    def keys_values(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """[B, S, W] -> k, v [B, H_kv, S, d]"""
        b, s, _ = x.shape
        k, v = linear(x, self.k_proj, self.v_proj)  # one fused matmul in CPU inference
        return (k.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2),
                v.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2))

    def queries_keys_values(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention: [B, T, W] -> q [B, H, T, d], k, v [B, H_kv, T, d] (one fused matmul in
        CPU inference)."""
        b, t, _ = x.shape
        q, k, v = linear(x, self.q_proj, self.k_proj, self.v_proj)
        return (q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2),
                k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2),
                v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2))

    def output(self, attn: Tensor) -> Tensor:
        """[B, H, T, d] -> [B, T, W]"""
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))


class KVCache:
    """One attention's K/V over a growing sequence: k, v [B, H_kv, T, d]; cropped on rollback.
    The building block of the target's caches (target.LayeredKVCache) and the drafters' own."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def select(self, index: Tensor) -> None:
        """Keep the positions `index` [n] (in order): a draft tree compacted to its accepted path."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(2, index), self.v.index_select(2, index)


class DecoderBlock(nn.Module):
    """A pre-norm Llama decoder block (RMSNorm -> attention -> residual -> RMSNorm -> SwiGLU)."""

    def __init__(self, width: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                 rope_theta: float = 10000.0, eps: float = 1e-6) -> None:
        super().__init__()
        self.input_norm = RMSNorm(width, eps)
        self.attn = AttentionProjections(width, width, num_heads, num_kv_heads, head_dim)
        self.post_norm = RMSNorm(width, eps)
        self.mlp = SwiGLU(width, intermediate)
        self.rotary = RotaryEmbedding(head_dim, rope_theta)

    def forward(self, hidden: Tensor, positions: Tensor, mask: Tensor, cache: KVCache | None = None) -> Tensor:
        """hidden [B, T, W] at positions [B, T]; mask [B, 1, T, T_past + T] -> [B, T, W]"""
        cos, sin = self.rotary(positions, hidden.dtype)
        q, k, v = self.attn.queries_keys_values(self.input_norm(hidden))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)
        h = hidden + self.attn.output(attend(q, k, v, mask))
        return h + self.mlp(self.post_norm(h))

    def keys_values(self, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """What the block caches for tokens hidden [B, T, W] at positions [B, T]: k, v [B, H_kv, T, d]
        (they depend on nothing else: a token fed only to be attended later needs no more)."""
        cos, sin = self.rotary(positions, hidden.dtype)
        k, v = self.attn.keys_values(self.input_norm(hidden))
        return apply_rotary(k, cos, sin), v


def causal_mask_after(past: int, n: int, device: torch.device | str) -> Tensor:
    """Mask [1, 1, n, past + n] for n new queries after `past` cached keys."""
    q = torch.arange(past, past + n, device=device)
    k = torch.arange(past + n, device=device)
    return (k[None, :] <= q[:, None])[None, None]
