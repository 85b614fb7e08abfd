"""Layer Self-Attention (LSA) straight from the target's paged per-layer KV caches.

The maths (``vllm_moa.kinds.moa.model.LayerSelfAttention.forward``), for one token with rows
``x_l`` (l = 0..L-1, width W = 2 * H_kv * d, see kernels/paged.py for the row layout), LSA heads
``H`` of size ``e = W / H`` and RoPE at the layer index ``l``::

    n_l   = RMSNorm_in(x_l)                                  = x_l * g / sqrt(mean(x_l^2) + eps)
    q_l, k_l, v_l = Wq n_l, Wk n_l, Wv n_l                   (split into H heads of size e)
    q_l, k_l = rope(q_l, l), rope(k_l, l)                    rotate-half, inv_freq of lsa.rotary
    a_l   = sum_m softmax_m(q_l . k_m / sqrt(e)) v_m         (per head; no mask: all L layers)
    h_l   = x_l + Wo a_l
    h_l   = h_l + MLP(RMSNorm_post(h_l))
    out   = Ekv2E(mean_l h_l)                                -> [E]

Shapes: slots [N] -> rows [N, L, W] -> out [N, E]. Tokens never mix.

What runs where (``lsa_rows_from_paged``)
-----------------------------------------
1. Triton ``lsa_qkv_kernel``: a gather-GEMM. Its A operand is read straight from the L paged
   caches (no [N, L, W] rows tensor, no stacked copy of the caches), the input RMSNorm is fused
   (the weight g on the A tile, the per-row 1/rms applied in the epilogue from a sum of squares
   accumulated along the same K loop), and it multiplies by the stacked [3W, W] q/k/v weight.
2. Triton ``lsa_layer_attention_kernel``: one program per (token, head) holds that head's L x e
   q/k/v on chip, applies RoPE at the layer index (angles computed in-kernel from lsa.rotary's
   inv_freq), softmax over the L layers (L padded to a power of two >= 16 and masked, so any L
   works), and writes the [N, L, W] attention output.
3. PyTorch ``o_proj`` (a dense GEMM: cuBLAS is as fast as a Triton GEMM and needs no tuning),
   then Triton ``lsa_residual_kernel`` adds the rows, again gathered from the caches, in place.
4. PyTorch post-norm, SwiGLU MLP, mean over layers and Ekv2E: three dense GEMMs of width
   ``lsa_intermediate_size`` dominate the FLOPs; cuBLAS runs them at peak and a fused Triton
   version would only save the elementwise norm/SiLU passes. The mean must come after the MLP
   (it is nonlinear), so nothing smaller than [N, L, W] can be carried past step 3.

Memory: intermediates (qkv [n, L, 3W], attention and residual [n, L, W], MLP [n, L, I]) are
bounded by processing at most ``chunk_tokens`` tokens at a time (default 256), whatever N is.
Inference only (no autograd through the Triton path).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._backend import dot_in_fp32, kernel_backend, load_triton_module, lsa_triton_max_tokens, use_triton
from .paged import Layout, PagedLayers, gather_layer_rows

DEFAULT_CHUNK_TOKENS = 256


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# ---------------------------------------------------------------------------------------------
# PyTorch twins
# ---------------------------------------------------------------------------------------------
def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """vllm_moa.layers.RMSNorm: weight * (x / sqrt(mean(x^2) + eps)) with the norm in fp32."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def lsa_qkv_reference(rows: Tensor, norm_weight: Tensor, eps: float, wqkv: Tensor) -> Tensor:
    """Twin of ``lsa_qkv_kernel``: rows [..., W] -> RMSNorm(rows) @ wqkv^T  [..., 3W]."""
    return F.linear(rms_norm_reference(rows, norm_weight, eps), wqkv)


def lsa_layer_attention_reference(qkv: Tensor, num_heads: int, inv_freq: Tensor) -> Tensor:
    """Twin of ``lsa_layer_attention_kernel``.

    qkv [N, L, 3W] (q | k | v, heads of size e = W / num_heads consecutive) -> [N, L, W]:
    per head, softmax(rope(q) rope(k)^T / sqrt(e)) v over the L layers, RoPE (rotate-half) at the
    layer index with frequencies inv_freq [e / 2]; no mask.
    """
    n, num_layers, three_w = qkv.shape
    w = three_w // 3
    e = w // num_heads
    q, k, v = (t.reshape(n, num_layers, num_heads, e).transpose(1, 2) for t in qkv.split(w, dim=-1))
    freqs = torch.arange(num_layers, device=qkv.device, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(qkv.dtype), emb.sin().to(qkv.dtype)

    def rope(x: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    out = F.scaled_dot_product_attention(rope(q), rope(k), v)  # [N, H, L, e]
    return out.transpose(1, 2).reshape(n, num_layers, w)


def _lsa_forward_rows(lsa: nn.Module, rows: Tensor) -> Tensor:
    """The module's own forward on gathered rows [n, L, W] -> [n, E]."""
    return lsa(rows)


def lsa_attention_reference(lsa: nn.Module, caches: Sequence[Tensor] | Tensor, slots: Tensor, *,
                            layout: Layout = "flash_attn", chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS) -> Tensor:
    """The PyTorch twin of ``lsa_rows_from_paged``: gather the rows of `slots` from the paged
    caches (kernels.paged.gather_layer_rows) and run `lsa` (a LayerSelfAttention) on them.

    caches: L per-layer caches in `layout` (or stacked [L, ...]); slots [N] -> [N, E].
    """
    slots = slots.reshape(-1)
    if slots.numel() == 0:
        return _empty_output(lsa, slots.device)
    chunk = chunk_tokens or slots.numel()
    outs = [_lsa_forward_rows(lsa, gather_layer_rows(caches, part, layout)) for part in slots.split(chunk)]
    return torch.cat(outs, dim=0)


def _empty_output(lsa: nn.Module, device: torch.device) -> Tensor:
    weight = lsa.ekv2e.weight
    return torch.empty(0, weight.shape[0], dtype=weight.dtype, device=device)


# ---------------------------------------------------------------------------------------------
# Triton path
# ---------------------------------------------------------------------------------------------
_WQKV_CACHE: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Tensor]] = weakref.WeakKeyDictionary()


def fused_qkv_weight(lsa: nn.Module) -> Tensor:
    """The stacked [3W, W] (q; k; v) projection weight of `lsa`, cached per module and rebuilt
    when a weight changes (in-place updates bump the tensor version)."""
    ws = (lsa.attn.q_proj.weight, lsa.attn.k_proj.weight, lsa.attn.v_proj.weight)
    key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in ws)
    hit = _WQKV_CACHE.get(lsa)
    if hit is not None and hit[0] == key:
        return hit[1]
    with torch.no_grad():
        fused = torch.cat([w.detach() for w in ws], dim=0).contiguous()
    _WQKV_CACHE[lsa] = (key, fused)
    return fused


def _gemm_blocks(dot_fp32: bool, on_gpu: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps). Untuned defaults; see benchmarks/bench_kernels.py."""
    if not on_gpu:  # interpreter: big tiles = fewer Python-level programs
        return 64, 128, 128, 4
    if dot_fp32:
        return 64, 64, 32, 4
    return 64, 128, 64, 4


def _column_block(head_dim: int, most: int) -> tuple[int, bool]:
    """A column-chunk size for reading LSA rows, and whether it divides the target head dim (then a
    chunk is one contiguous run of one head's K or V: vectorised loads)."""
    block = most
    while block >= 16:
        if head_dim % block == 0:
            return block, True
        block //= 2
    return min(most, 32), False


def lsa_qkv_paged(paged: PagedLayers, slots: Tensor, norm_weight: Tensor, eps: float, wqkv: Tensor) -> Tensor:
    """Triton: q/k/v of RMSNorm'd LSA rows gathered from paged caches.

    slots [n] -> [n * L, 3W] (row r = token r // L, layer r % L) in wqkv's dtype.
    Twin: ``lsa_qkv_reference(gather_layer_rows(caches, slots), norm_weight, eps, wqkv)``.
    """
    lsa_qkv_kernel = load_triton_module("._lsa_triton").lsa_qkv_kernel

    n, num_layers, w = slots.numel(), paged.num_layers, paged.row_width
    if wqkv.shape[1] != w or norm_weight.shape[0] != w:
        raise ValueError(f"LSA width {wqkv.shape[1]} does not match the caches' row width 2*H_kv*d={w}")
    m, nout = n * num_layers, wqkv.shape[0]
    out = torch.empty(m, nout, dtype=wqkv.dtype, device=wqkv.device)
    if m == 0:
        return out
    device = wqkv.device
    dot_fp32 = dot_in_fp32(wqkv.dtype, device)
    bm, bn, bk, warps = _gemm_blocks(dot_fp32, device.type == "cuda")
    bk, in_head = _column_block(paged.head_dim, bk)
    s_blk, s_off, s_head, s_dim = paged.strides
    grid = (triton_cdiv(m, bm), triton_cdiv(nout, bn))
    lsa_qkv_kernel[grid](
        paged.base, paged.layer_offsets, slots, norm_weight, wqkv, out,
        m, num_layers, w, nout, float(eps),
        paged.v_offset, paged.block_size, s_blk, s_off, s_head, s_dim,
        wqkv.stride(0), wqkv.stride(1), out.stride(0),
        D=paged.head_dim, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IN_HEAD=in_head, DOT_FP32=dot_fp32,
        num_warps=warps, num_stages=3 if device.type == "cuda" else 1,
    )
    return out


def lsa_layer_attention(qkv: Tensor, num_layers: int, num_heads: int, inv_freq: Tensor) -> Tensor:
    """Triton: attention over the layer axis. qkv [n * L, 3W] -> [n * L, W].

    Twin: ``lsa_layer_attention_reference(qkv.view(n, L, 3W), num_heads, inv_freq)``.
    """
    lsa_layer_attention_kernel = load_triton_module("._lsa_triton").lsa_layer_attention_kernel

    m, three_w = qkv.shape
    w = three_w // 3
    e = w // num_heads
    if e % 2 or e * num_heads != w:
        raise ValueError(f"LSA heads: width {w} is not num_heads={num_heads} heads of even size")
    out = torch.empty(m, w, dtype=qkv.dtype, device=qkv.device)
    n = m // num_layers
    if n == 0:
        return out
    half = e // 2
    dot_fp32 = dot_in_fp32(qkv.dtype, qkv.device)
    inv_freq = inv_freq.to(device=qkv.device, dtype=torch.float32).contiguous()
    block_l = max(16, _next_pow2(num_layers))
    block_h = max(16, _next_pow2(half))
    on_gpu = qkv.device.type == "cuda"
    lsa_layer_attention_kernel[(n, num_heads)](
        qkv, out, inv_freq,
        num_layers, w, 1.0 / (e ** 0.5), qkv.stride(0), out.stride(0),
        HALF=half, BLOCK_L=block_l, BLOCK_H=block_h, DOT_FP32=dot_fp32,
        num_warps=8 if on_gpu and block_l * block_h >= 4096 else 4,
        num_stages=1,
    )
    return out


def lsa_add_rows_paged(h: Tensor, paged: PagedLayers, slots: Tensor) -> Tensor:
    """Triton: h [n * L, W] += the LSA rows of `slots` read from the caches (in place)."""
    lsa_residual_kernel = load_triton_module("._lsa_triton").lsa_residual_kernel

    m, w = h.shape
    if m == 0:
        return h
    on_gpu = h.device.type == "cuda"
    bm, bw = (32, 128) if on_gpu else (64, 256)
    bw, in_head = _column_block(paged.head_dim, bw)
    s_blk, s_off, s_head, s_dim = paged.strides
    lsa_residual_kernel[(triton_cdiv(m, bm), triton_cdiv(w, bw))](
        h, paged.base, paged.layer_offsets, slots,
        m, paged.num_layers, w,
        paged.v_offset, paged.block_size, s_blk, s_off, s_head, s_dim, h.stride(0),
        D=paged.head_dim, BLOCK_M=bm, BLOCK_W=bw, IN_HEAD=in_head, num_warps=4,
    )
    return h


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@torch.no_grad()
def lsa_rows_from_paged(lsa: nn.Module, caches: Sequence[Tensor] | Tensor, slots: Tensor, *,
                        layout: Layout = "flash_attn", chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS) -> Tensor:
    """Ekv2E rows of token `slots`, read straight from the target's paged per-layer caches.

    lsa:    a ``vllm_moa.kinds.moa.model.LayerSelfAttention`` (duck-typed: input_norm, attn.{q,k,v,o}_proj,
            rotary.inv_freq, num_heads, post_norm, mlp, ekv2e); its dtype must be the caches' dtype
    caches: L per-layer caches in `layout` (kernels/paged.py) or one stacked [L, ...] tensor
    slots:  [N] int slots (block * block_size + offset), any blocks, any order
    returns [N, E], equal to ``lsa(gather_layer_rows(caches, slots))`` (the twin,
    ``lsa_attention_reference``) up to floating-point rounding. Triton for steps 1-3 of the
    module docstring, PyTorch for the rest. Inference only.
    """
    paged = PagedLayers.from_caches(caches, layout)
    slots = slots.reshape(-1).to(paged.base.device)
    if slots.numel() == 0:
        return _empty_output(lsa, slots.device)
    num_layers, w = paged.num_layers, paged.row_width
    norm_w = lsa.input_norm.weight.detach()
    wqkv = fused_qkv_weight(lsa)
    wo = lsa.attn.o_proj.weight.detach()
    inv_freq = lsa.rotary.inv_freq
    if paged.base.dtype != wqkv.dtype:
        raise ValueError(f"KV cache dtype {paged.base.dtype} differs from the LSA weights' dtype {wqkv.dtype}")
    chunk = chunk_tokens or slots.numel()
    outs = []
    for part in slots.split(chunk):
        n = part.numel()
        qkv = lsa_qkv_paged(paged, part, norm_w, lsa.input_norm.eps, wqkv)  # [n*L, 3W]
        attn = lsa_layer_attention(qkv, num_layers, lsa.num_heads, inv_freq)  # [n*L, W]
        del qkv
        h = lsa_add_rows_paged(F.linear(attn, wo), paged, part)  # x + Wo a
        del attn
        h = h.view(n, num_layers, w)
        h = h + lsa.mlp(lsa.post_norm(h))
        outs.append(lsa.ekv2e(h.mean(dim=1)))
    return torch.cat(outs, dim=0)


def lsa_attention(lsa: nn.Module, caches: Sequence[Tensor] | Tensor, slots: Tensor, *,
                  layout: Layout = "flash_attn", chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
                  backend: str | None = None) -> Tensor:
    """LSA rows [N, E] of token `slots` from paged caches: ``lsa_rows_from_paged`` (Triton) or
    ``lsa_attention_reference`` (PyTorch), as ``use_triton`` decides for the caches' device
    ($VLLM_MOA_KERNELS, or `backend`); under "auto", calls over more than
    $VLLM_MOA_LSA_TRITON_MAX_TOKENS tokens (default 256: prefill) take the twin, which is faster
    there on an H200."""
    first = caches[0] if not isinstance(caches, Tensor) else caches
    large = kernel_backend(backend) == "auto" and slots.numel() > lsa_triton_max_tokens()
    if not large and use_triton(first.device, backend):
        return lsa_rows_from_paged(lsa, caches, slots, layout=layout, chunk_tokens=chunk_tokens)
    return lsa_attention_reference(lsa, caches, slots, layout=layout, chunk_tokens=chunk_tokens)
