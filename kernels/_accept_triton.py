"""Triton kernels of tree acceptance (imported only where Triton is installed).

See kernels/accept.py for the rules, the shapes and the conventions.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tree_accept_greedy_kernel(
    draft_ptr, target_ptr, parents_ptr, anc_ptr, cu_ptr,
    num_acc_ptr, best_ptr, bonus_ptr, path_ptr, s_path,
    MAX_NODES: tl.constexpr,
):
    """One program per tree: node i is accepted iff every non-root node on its root path matches
    the target's greedy token after its parent; the deepest accepted node (lowest index on ties)
    ends the accepted path."""
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    i = tl.arange(0, MAX_NODES)
    bits = i.to(tl.int64)
    valid = i < n
    par = tl.load(parents_ptr + start + i, mask=valid, other=-1)
    tok = tl.load(draft_ptr + start + i, mask=valid, other=0)
    want = tl.load(target_ptr + start + par, mask=valid & (par >= 0), other=0)
    match = valid & ((par < 0) | (tok == want))
    match_bits = tl.sum(tl.where(match, 1, 0).to(tl.int64) << bits, axis=0)  # distinct bits: sum == or
    anc = tl.load(anc_ptr + start + i, mask=valid, other=0)
    ok = valid & ((anc & ~match_bits) == 0)
    depth = tl.sum((anc[:, None] >> bits[None, :]) & 1, axis=1).to(tl.int32) - 1
    key = tl.where(ok, depth * MAX_NODES + (MAX_NODES - 1 - i), -1)
    best_key = tl.max(key, axis=0)
    found = best_key >= 0
    best = tl.where(found, MAX_NODES - 1 - best_key % MAX_NODES, -1)
    best_depth = tl.where(found, best_key // MAX_NODES, -1)
    anc_best = tl.sum(tl.where(i == best, anc, 0), axis=0)
    on_path = valid & (((anc_best >> bits) & 1) != 0)
    row = path_ptr + b.to(tl.int64) * s_path
    tl.store(row + i, tl.full((MAX_NODES,), -1, tl.int32), mask=i > best_depth)
    tl.store(row + tl.where(on_path, depth, 0), i.to(tl.int32), mask=on_path)
    tl.store(num_acc_ptr + b, tl.maximum(best_depth, 0))
    tl.store(best_ptr + b, best)
    bonus = tl.load(target_ptr + start + tl.maximum(best, 0), mask=found, other=-1)
    tl.store(bonus_ptr + b, bonus.to(tl.int64))


@triton.jit
def tree_accept_sampling_kernel(
    draft_ptr, parents_ptr, cu_ptr, p_ptr, q_ptr, s_p, s_q, uni_ptr, bonus_uni_ptr, scratch_ptr, V,
    num_acc_ptr, best_ptr, bonus_ptr, path_ptr, s_path,
    MAX_NODES: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program per tree: recursive rejection sampling down the tree (see kernels/accept.py)."""
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    row_path = path_ptr + b.to(tl.int64) * s_path
    scratch = scratch_ptr + b.to(tl.int64) * V
    nodes = tl.arange(0, MAX_NODES)
    tl.store(row_path + nodes, tl.where((nodes == 0) & (n > 0), 0, -1).to(tl.int32))
    zero = b * 0
    u = zero
    depth = zero
    use_scratch = zero  # 1: the current distribution is the residual in `scratch`, scaled by 1/z
    z = zero.to(tl.float32) + 1.0
    going = n > 0
    while going:
        use_scratch = zero
        z = zero.to(tl.float32) + 1.0
        p_row = p_ptr + (start + u).to(tl.int64) * s_p
        q_row = q_ptr + (start + u).to(tl.int64) * s_q
        child = zero - 1
        c = u + 1
        while (c < n) & (child < 0):
            if tl.load(parents_ptr + start + c) == u:
                x = tl.load(draft_ptr + start + c)
                qx = tl.load(q_row + x).to(tl.float32)
                if use_scratch == 1:
                    px = tl.load(scratch + x) / z
                else:
                    px = tl.load(p_row + x).to(tl.float32)
                if tl.load(uni_ptr + start + c) * qx < px:
                    child = c
                else:  # reject: residual <- max(residual - q, 0), renormalised through z
                    z_new = zero.to(tl.float32)
                    for v0 in range(0, V, BLOCK_V):
                        vv = v0 + tl.arange(0, BLOCK_V)
                        m = vv < V
                        if use_scratch == 1:
                            r = tl.load(scratch + vv, mask=m, other=0.0) / z
                        else:
                            r = tl.load(p_row + vv, mask=m, other=0.0).to(tl.float32)
                        qq = tl.load(q_row + vv, mask=m, other=0.0).to(tl.float32)
                        r = tl.maximum(r - qq, 0.0)
                        tl.store(scratch + vv, r, mask=m)
                        z_new += tl.sum(r, axis=0)
                    use_scratch = zero + 1
                    z = tl.where(z_new > 0.0, z_new, 1.0)
            c += 1
        if child >= 0:
            u = child
            depth += 1
            tl.store(row_path + depth, u.to(tl.int32))
        going = child >= 0
    # bonus token: inverse CDF of the final distribution (residual, or the target's at the leaf)
    p_row = p_ptr + (start + u).to(tl.int64) * s_p
    thr = tl.load(bonus_uni_ptr + b) * z
    running = zero.to(tl.float32)
    token = zero + V
    last = zero - 1
    for v0 in range(0, V, BLOCK_V):
        vv = v0 + tl.arange(0, BLOCK_V)
        m = vv < V
        if use_scratch == 1:
            r = tl.load(scratch + vv, mask=m, other=0.0)
        else:
            r = tl.load(p_row + vv, mask=m, other=0.0).to(tl.float32)
        cs = tl.cumsum(r, axis=0) + running
        hit = m & (r > 0.0) & (cs > thr)
        token = tl.minimum(token, tl.min(tl.where(hit, vv, V), axis=0))
        last = tl.maximum(last, tl.max(tl.where(m & (r > 0.0), vv, -1), axis=0))
        running += tl.sum(r, axis=0)
    token = tl.where(token == V, last, token)
    ok = n > 0
    tl.store(num_acc_ptr + b, tl.where(ok, depth, 0))
    tl.store(best_ptr + b, tl.where(ok, u, -1))
    tl.store(bonus_ptr + b, tl.where(ok, token, -1).to(tl.int64))
