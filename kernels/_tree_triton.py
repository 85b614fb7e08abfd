"""Triton kernel of tree attention over a paged KV cache (imported only where Triton is installed).

See kernels/tree.py for the maths, the shapes and the conventions.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_FP32: tl.constexpr):
    """One key tile of flash attention in the log2 domain; rows with no allowed key stay empty."""
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(allowed, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def tree_attention_kernel(
    q_ptr, out_ptr, lse_ptr, k_ptr, v_ptr, block_tables_ptr, prefix_lens_ptr, cu_q_ptr, anc_ptr,
    num_kv_heads, group, head_dim, qk_scale,
    s_qt, s_qh, s_os, s_ot, s_oh, s_ls, s_lt,
    block_size, s_blk, s_off, s_head, s_dim, s_bt,
    NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Program (query tile, (sequence, KV head), split). Query rows of one sequence and KV head
    are packed as r = g * n + i (g: query head within the GQA group, i: tree node), so one K/V
    tile serves the whole group. Split s covers its share of the cached prefix; the last split
    also covers the tree's own tokens under the ancestor mask."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads
    q_start = tl.load(cu_q_ptr + b)
    n = tl.load(cu_q_ptr + b + 1) - q_start
    if pid_m * BLOCK_M >= group * n:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < group * n
    g = rows // n
    node = rows % n
    head = kvh * group + g
    tok = (q_start + node).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < head_dim
    q = tl.load(q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + dims[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    anc = tl.load(anc_ptr + tok, mask=row_mask, other=0)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    kv_head = kvh.to(tl.int64) * s_head + dims[None, :].to(tl.int64) * s_dim
    bt_row = block_tables_ptr + b.to(tl.int64) * s_bt

    # cached prefix: positions [start, end) of this split, no mask
    prefix = tl.load(prefix_lens_ptr + b)
    chunk = ((prefix + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, prefix)
    for s0 in range(start, end, BLOCK_N):
        pos = s0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        phys = tl.load(bt_row + pos // block_size, mask=valid, other=0).to(tl.int64)
        kv = phys[:, None] * s_blk + (pos % block_size).to(tl.int64)[:, None] * s_off + kv_head
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv, mask=kv_mask, other=0.0)
        m_i, l_i, acc = _online_softmax_step(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, DOT_FP32)

    # the tree's own tokens at positions prefix + j: node i sees node j iff bit j of anc[i]
    if split == NUM_SPLITS - 1:
        for j0 in range(0, n, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            valid = j < n
            pos = prefix + j
            phys = tl.load(bt_row + pos // block_size, mask=valid, other=0).to(tl.int64)
            kv = phys[:, None] * s_blk + (pos % block_size).to(tl.int64)[:, None] * s_off + kv_head
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + kv, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kv, mask=kv_mask, other=0.0)
            bit = (anc[:, None] >> j[None, :].to(tl.int64)) & 1
            allowed = valid[None, :] & (bit != 0)
            m_i, l_i, acc = _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_FP32)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    o_ptrs = out_ptr + split * s_os + tok[:, None] * s_ot + head[:, None] * s_oh + dims[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # log2 domain
        tl.store(lse_ptr + split * s_ls + tok * s_lt + head, lse, mask=row_mask)
