"""Tree acceptance: the longest path of a drafted token tree that the target accepts.

Conventions (the trees of kernels/tree.py, with one extra rule)
---------------------------------------------------------------
Each tree has exactly one root, node 0 (``parents[0] == -1``): the last token the target already
accepted, whose successor distribution the verification pass computes. Nodes are in topological
order (``parents[i] < i``), at most 64 per tree, ragged across the batch via ``cu_seqlens``.

* draft_tokens  [T] int    token of each node (the root's is not used)
* parents       [T] int    parent of each node within its tree, -1 for the root
* cu_seqlens    [B + 1]    tree offsets

Greedy (``tree_accept_greedy``), with target_tokens [T] = the target's argmax after each node and
ancestor_masks [T] from ``tree_ancestor_masks``::

    node i accepted  <=>  every non-root node j on the root->i path has
                          draft_tokens[j] == target_tokens[parent(j)]
    best  = the deepest accepted node (lowest index on ties); bonus = target_tokens[best]

Sampling (``tree_accept_sampling``): recursive rejection sampling (SpecInfer's multi-draft
speculative sampling), lossless when the children of a node were drawn i.i.d. from that node's
draft distribution. With target_probs / draft_probs [T, V] (row u: the target's / drafter's
distribution of the token after node u, normalised), uniforms [T] (one per node) and
bonus_uniforms [B], starting at u = root::

    R = target_probs[u]; Z = 1
    for each child c of u, in index order:
        x = draft_tokens[c]
        if uniforms[c] * draft_probs[u, x] < R[x] / Z:  accept c; u = c; next level
        else:  R = max(R / Z - draft_probs[u], 0); Z = sum(R)           (Z := 1 if it is 0)
    no child accepted (or u is a leaf): bonus = the first token t with R[t] > 0 and
        cumsum(R)[t] > bonus_uniforms[b] * Z  (the last token with R > 0 if rounding leaves none)

Outputs (``TreeAcceptance``), per tree: num_accepted [B] int32 (accepted non-root nodes = depth
of best), best_node [B] int32 (index within the tree), bonus_token [B] int64, path [B, 64] int32
(root first, then the accepted nodes by depth, -1 after). An empty tree gives 0, -1, -1 and -1s.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._backend import load_triton_module, use_triton
from .tree import MAX_TREE_NODES, ancestor_bits


class TreeAcceptance(NamedTuple):
    num_accepted: Tensor  # [B] int32
    best_node: Tensor  # [B] int32
    bonus_token: Tensor  # [B] int64
    path: Tensor  # [B, 64] int32


def _empty_result(batch: int, device: torch.device) -> TreeAcceptance:
    return TreeAcceptance(
        torch.zeros(batch, dtype=torch.int32, device=device),
        torch.full((batch,), -1, dtype=torch.int32, device=device),
        torch.full((batch,), -1, dtype=torch.int64, device=device),
        torch.full((batch, MAX_TREE_NODES), -1, dtype=torch.int32, device=device),
    )


def _check_tree(parents: list[int]) -> None:
    if parents and parents[0] != -1:
        raise ValueError("tree acceptance needs node 0 to be the root (parents[0] == -1)")
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise ValueError("tree acceptance needs one root and topological order (0 <= parents[i] < i)")
    if len(parents) > MAX_TREE_NODES:
        raise ValueError(f"a tree has more than {MAX_TREE_NODES} nodes")


# ---------------------------------------------------------------------------------------------
# PyTorch twins
# ---------------------------------------------------------------------------------------------
def tree_accept_greedy_reference(draft_tokens: Tensor, target_tokens: Tensor, parents: Tensor,
                                 ancestor_masks: Tensor, cu_seqlens: Tensor) -> TreeAcceptance:
    """Twin of the greedy kernel (see the module docstring)."""
    cu = cu_seqlens.tolist()
    out = _empty_result(len(cu) - 1, draft_tokens.device)
    for b in range(len(cu) - 1):
        lo, hi = cu[b], cu[b + 1]
        n = hi - lo
        if n == 0:
            continue
        par = parents[lo:hi].long()
        _check_tree(par.tolist())
        tok, tgt = draft_tokens[lo:hi].long(), target_tokens[lo:hi].long()
        match = (par < 0) | (tok == tgt[par.clamp(min=0)])
        anc = ancestor_bits(ancestor_masks[lo:hi], n)  # [n, n]
        ok = ~(anc & ~match[None, :]).any(dim=1)
        depth = anc.sum(dim=1) - 1
        key = torch.where(ok, depth * MAX_TREE_NODES + (MAX_TREE_NODES - 1 - torch.arange(n, device=anc.device)), -1)
        best = int(MAX_TREE_NODES - 1 - int(key.max()) % MAX_TREE_NODES)
        d = int(depth[best])
        on_path = anc[best].nonzero().flatten()
        out.path[b, depth[on_path]] = on_path.to(torch.int32)
        out.num_accepted[b], out.best_node[b], out.bonus_token[b] = d, best, tgt[best]
    return out


def _sample_inverse_cdf(r: Tensor, threshold: float) -> int:
    cs = torch.cumsum(r, dim=0)
    hit = ((r > 0) & (cs > threshold)).nonzero()
    if len(hit):
        return int(hit[0])
    nz = (r > 0).nonzero()
    return int(nz[-1]) if len(nz) else -1


def tree_accept_sampling_reference(draft_tokens: Tensor, parents: Tensor, cu_seqlens: Tensor, target_probs: Tensor,
                                   draft_probs: Tensor, uniforms: Tensor, bonus_uniforms: Tensor) -> TreeAcceptance:
    """Twin of the sampling kernel (see the module docstring); fp32 arithmetic in the same order."""
    cu = cu_seqlens.tolist()
    out = _empty_result(len(cu) - 1, draft_tokens.device)
    for b in range(len(cu) - 1):
        lo, hi = cu[b], cu[b + 1]
        n = hi - lo
        if n == 0:
            continue
        par = parents[lo:hi].tolist()
        _check_tree(par)
        children = [[] for _ in range(n)]
        for c in range(1, n):
            children[par[c]].append(c)
        u, depth = 0, 0
        out.path[b, 0] = 0
        while True:
            r, z, child = target_probs[lo + u].float(), torch.tensor(1.0), -1
            q = draft_probs[lo + u].float()
            for c in children[u]:
                x = int(draft_tokens[lo + c])
                if uniforms[lo + c].float() * q[x] < r[x] / z:
                    child = c
                    break
                r = torch.clamp(r / z - q, min=0.0)
                total = r.sum()
                z = total if total > 0 else torch.tensor(1.0)
            if child < 0:
                break
            u, depth = child, depth + 1
            out.path[b, depth] = u
        out.num_accepted[b], out.best_node[b] = depth, u
        out.bonus_token[b] = _sample_inverse_cdf(r, float(bonus_uniforms[b].float() * z))
    return out


# ---------------------------------------------------------------------------------------------
# Triton + dispatch
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def tree_accept_greedy_triton(draft_tokens: Tensor, target_tokens: Tensor, parents: Tensor, ancestor_masks: Tensor,
                              cu_seqlens: Tensor) -> TreeAcceptance:
    """Greedy tree acceptance in one Triton launch (one program per tree)."""
    kernel = load_triton_module("._accept_triton").tree_accept_greedy_kernel
    device = draft_tokens.device
    batch = cu_seqlens.numel() - 1
    out = _empty_result(batch, device)
    if batch == 0:
        return out
    kernel[(batch,)](
        draft_tokens.contiguous(), target_tokens.contiguous(), parents.to(torch.int32).contiguous(),
        ancestor_masks.to(torch.int64).contiguous(), cu_seqlens.to(device=device, dtype=torch.int32),
        out.num_accepted, out.best_node, out.bonus_token, out.path, out.path.stride(0),
        MAX_NODES=MAX_TREE_NODES, num_warps=2,
    )
    return out


@torch.no_grad()
def tree_accept_sampling_triton(draft_tokens: Tensor, parents: Tensor, cu_seqlens: Tensor, target_probs: Tensor,
                                draft_probs: Tensor, uniforms: Tensor, bonus_uniforms: Tensor) -> TreeAcceptance:
    """Tree speculative sampling in one Triton launch (one program per tree; a [B, V] fp32
    scratch holds each tree's residual distribution)."""
    kernel = load_triton_module("._accept_triton").tree_accept_sampling_kernel
    device = draft_tokens.device
    batch = cu_seqlens.numel() - 1
    out = _empty_result(batch, device)
    if batch == 0:
        return out
    vocab = target_probs.shape[1]
    target_probs = target_probs if target_probs.stride(1) == 1 else target_probs.contiguous()
    draft_probs = draft_probs if draft_probs.stride(1) == 1 else draft_probs.contiguous()
    scratch = torch.empty(batch, vocab, dtype=torch.float32, device=device)
    block_v = 1024 if device.type == "cuda" else 256
    kernel[(batch,)](
        draft_tokens.contiguous(), parents.to(torch.int32).contiguous(),
        cu_seqlens.to(device=device, dtype=torch.int32),
        target_probs, draft_probs, target_probs.stride(0), draft_probs.stride(0),
        uniforms.float().contiguous(), bonus_uniforms.float().contiguous(), scratch, vocab,
        out.num_accepted, out.best_node, out.bonus_token, out.path, out.path.stride(0),
        MAX_NODES=MAX_TREE_NODES, BLOCK_V=block_v, num_warps=4,
    )
    return out


def tree_accept_greedy(draft_tokens: Tensor, target_tokens: Tensor, parents: Tensor, ancestor_masks: Tensor,
                       cu_seqlens: Tensor, *, backend: str | None = None) -> TreeAcceptance:
    """Greedy tree acceptance (Triton or the twin, per ``use_triton``)."""
    if use_triton(draft_tokens.device, backend):
        return tree_accept_greedy_triton(draft_tokens, target_tokens, parents, ancestor_masks, cu_seqlens)
    return tree_accept_greedy_reference(draft_tokens, target_tokens, parents, ancestor_masks, cu_seqlens)


def tree_accept_sampling(draft_tokens: Tensor, parents: Tensor, cu_seqlens: Tensor, target_probs: Tensor,
                         draft_probs: Tensor, uniforms: Tensor, bonus_uniforms: Tensor, *,
                         backend: str | None = None) -> TreeAcceptance:
    """Tree speculative sampling (Triton or the twin, per ``use_triton``)."""
    args = (draft_tokens, parents, cu_seqlens, target_probs, draft_probs, uniforms, bonus_uniforms)
    if use_triton(draft_tokens.device, backend):
        return tree_accept_sampling_triton(*args)
    return tree_accept_sampling_reference(*args)
