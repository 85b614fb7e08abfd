"""Triton kernels of LSA over paged caches (imported only where Triton is installed).

See kernels/lsa.py for the maths, the shapes and the split between Triton and PyTorch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_addresses(slots_ptr, layer_off_ptr, rows, row_mask, L, block_size, s_blk, s_off):
    """LSA row r = token * L + layer -> element offset of that token's layer-l K view origin."""
    tok = rows // L
    layer = rows % L
    slot = tl.load(slots_ptr + tok, mask=row_mask, other=0).to(tl.int64)
    blk = slot // block_size
    off = slot % block_size
    lay = tl.load(layer_off_ptr + layer, mask=row_mask, other=0)
    return lay + blk * s_blk + off * s_off


@triton.jit
def _col_offsets(k0, BLOCK: tl.constexpr, v_offset, s_head, s_dim, D: tl.constexpr, IN_HEAD: tl.constexpr):
    """LSA row columns k0 .. k0 + BLOCK - 1 -> element offsets inside one token's layer: column c
    is head c // 2D, K if c % 2D < D else V, element c % D. IN_HEAD (BLOCK divides D): the whole
    chunk lies in one head's K or V, so the offsets are a contiguous run (vectorised loads)."""
    if IN_HEAD:
        head = k0 // (2 * D)
        is_v = (k0 % (2 * D)) // D
        elem = k0 % D + tl.arange(0, BLOCK)
        return head.to(tl.int64) * s_head + is_v.to(tl.int64) * v_offset + elem.to(tl.int64) * s_dim
    cols = k0 + tl.arange(0, BLOCK)
    head = cols // (2 * D)
    rem = cols % (2 * D)
    is_v = rem // D
    elem = rem % D
    return head.to(tl.int64) * s_head + is_v.to(tl.int64) * v_offset + elem.to(tl.int64) * s_dim


@triton.jit
def lsa_qkv_kernel(
    cache_ptr, layer_off_ptr, slots_ptr, norm_w_ptr, w_ptr, out_ptr,
    M, L, W, NOUT, eps,
    v_offset, block_size, s_blk, s_off, s_head, s_dim,
    s_wn, s_wk, s_om,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IN_HEAD: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """out[r, n] = rsqrt(mean_c x[r, c]^2 + eps) * sum_c x[r, c] g[c] Wqkv[n, c],
    with x[r] the LSA row of (token r // L, layer r % L) read from the paged caches."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    row_base = _row_addresses(slots_ptr, layer_off_ptr, rows, row_mask, L, block_size, s_blk, s_off)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < NOUT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, W, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < W
        col_off = _col_offsets(k0, BLOCK_K, v_offset, s_head, s_dim, D, IN_HEAD)
        x = tl.load(cache_ptr + row_base[:, None] + col_off[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        sumsq += tl.sum(x * x, axis=1)
        g = tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        a = x * g[None, :]
        wt = tl.load(w_ptr + cols[None, :].to(tl.int64) * s_wn + ks[:, None] * s_wk,
                     mask=k_mask[:, None] & col_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_FP32:
            acc = tl.dot(a, wt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a.to(wt.dtype), wt, acc)
    scale = 1.0 / tl.sqrt(sumsq / W + eps)
    out = acc * scale[:, None]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * s_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def lsa_layer_attention_kernel(
    qkv_ptr, out_ptr, inv_freq_ptr,
    L, W, sm_scale, s_qm, s_om,
    HALF: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """One (token, head): softmax(rope(q) rope(k)^T * scale) v over the L layers, RoPE at the
    layer index (rotate-half), no mask. qkv [N*L, 3W] = (q | k | v), out [N*L, W]."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    lay = tl.arange(0, BLOCK_L)
    l_mask = lay < L
    e = tl.arange(0, BLOCK_H)
    e_mask = e < HALF
    mask = l_mask[:, None] & e_mask[None, :]
    rows = (tok * L + lay).to(tl.int64)
    col = head * 2 * HALF + e
    base = qkv_ptr + rows[:, None] * s_qm + col[None, :]
    q1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    q2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    k1 = tl.load(base + W, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(base + W + HALF, mask=mask, other=0.0).to(tl.float32)
    v1 = tl.load(base + 2 * W, mask=mask, other=0.0)
    v2 = tl.load(base + 2 * W + HALF, mask=mask, other=0.0)
    inv_freq = tl.load(inv_freq_ptr + e, mask=e_mask, other=0.0)
    angle = lay.to(tl.float32)[:, None] * inv_freq[None, :]
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    # rotate-half: x' = x * cos + [-x2, x1] * sin (cos/sin repeat over the two halves)
    q1r = q1 * cos - q2 * sin
    q2r = q2 * cos + q1 * sin
    k1r = k1 * cos - k2 * sin
    k2r = k2 * cos + k1 * sin
    if DOT_FP32:
        s = tl.dot(q1r, tl.trans(k1r), input_precision="ieee")
        s = tl.dot(q2r, tl.trans(k2r), s, input_precision="ieee")
    else:
        s = tl.dot(q1r.to(v1.dtype), tl.trans(k1r.to(v1.dtype)))
        s = tl.dot(q2r.to(v1.dtype), tl.trans(k2r.to(v1.dtype)), s)
    s = tl.where(l_mask[None, :], s * sm_scale, float("-inf"))
    m = tl.max(s, axis=1)
    p = tl.exp(s - m[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    if DOT_FP32:
        o1 = tl.dot(p, v1.to(tl.float32), input_precision="ieee")
        o2 = tl.dot(p, v2.to(tl.float32), input_precision="ieee")
    else:
        o1 = tl.dot(p.to(v1.dtype), v1)
        o2 = tl.dot(p.to(v1.dtype), v2)
    out = out_ptr + rows[:, None] * s_om + col[None, :]
    tl.store(out, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def lsa_residual_kernel(
    h_ptr, cache_ptr, layer_off_ptr, slots_ptr,
    M, L, W,
    v_offset, block_size, s_blk, s_off, s_head, s_dim, s_hm,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, IN_HEAD: tl.constexpr,
):
    """h[r, c] += x[r, c] in place (the residual), x read from the paged caches."""
    pid_m = tl.program_id(0)
    pid_w = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    row_base = _row_addresses(slots_ptr, layer_off_ptr, rows, row_mask, L, block_size, s_blk, s_off)
    cols = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = row_mask[:, None] & (cols < W)[None, :]
    col_off = _col_offsets(pid_w * BLOCK_W, BLOCK_W, v_offset, s_head, s_dim, D, IN_HEAD)
    x = tl.load(cache_ptr + row_base[:, None] + col_off[None, :],
                mask=mask, other=0.0)
    hp = h_ptr + rows[:, None].to(tl.int64) * s_hm + cols[None, :]
    h = tl.load(hp, mask=mask, other=0.0)
    tl.store(hp, (h.to(tl.float32) + x.to(tl.float32)).to(h_ptr.dtype.element_ty), mask=mask)
