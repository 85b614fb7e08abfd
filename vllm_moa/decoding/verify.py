"""Accepting a verified draft tree: greedy, or lossless recursive rejection sampling.

The target ran over every node of the tree in one forward; row i of its logits is the target's
next-token distribution after the path root..i. Both rules walk down from the root and return the
accepted path (node ids, root first) and the next token, which becomes the next round's root.

Sampling (SpecInfer's multi-draft rule; Miao et al., 2024): at node u with target distribution p,
try u's children c_1, c_2, ... in order; child c with token x, drawn from q_c (the drafter's warped
distribution for a sampled chain; a point mass on x for the deterministic top-k children of a
tree), is accepted with probability min(1, p(x) / q_c(x)); on rejection p <- norm(max(p - q_c, 0))
and the next child is tried; if every child is rejected the next token is drawn from p. For a
single child this is standard speculative sampling; for point-mass children it removes each
rejected token from p. Either way the token after u is distributed exactly as the target's own
sampling (tests/unit/test_sampling.py checks chains and trees with chi-square tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_moa.decoding.sampling import sample
from vllm_moa.decoding.tree import DraftTree


def greedy_accept(tree: DraftTree, target_logits: Tensor) -> tuple[list[int], int]:
    """target_logits [N, V] -> (accepted path, the target's argmax after it)."""
    return greedy_accept_choices(tree, target_logits.argmax(-1).tolist())


def greedy_accept_choices(tree: DraftTree, choice: list[int]) -> tuple[list[int], int]:
    """The target's argmax at each node [N] -> (accepted path, the target's argmax after it)."""
    tokens = tree.tokens.tolist()
    children = tree.children()
    node, path = 0, [0]
    while True:
        nxt = next((c for c in children[node] if tokens[c] == choice[node]), None)
        if nxt is None:
            return path, choice[node]
        node = nxt
        path.append(node)


def sampled_accept(tree: DraftTree, target_probs: Tensor,
                   generator: torch.Generator | None) -> tuple[list[int], int]:
    """target_probs [N, V] (warped) -> (accepted path, next token sampled losslessly)."""
    tokens = tree.tokens.tolist()
    children = tree.children()
    node, path = 0, [0]
    while True:
        p = target_probs[node]
        accepted = None
        for child in children[node]:
            x = tokens[child]
            q = tree.probs[child] if tree.probs is not None else None
            qx = float(q[x]) if q is not None else 1.0
            u = float(torch.rand((), generator=generator, device=p.device))
            if qx > 0 and u * qx <= float(p[x]):
                accepted = child
                break
            residual = (p - q).clamp_min(0) if q is not None else p.clone().index_fill_(0, torch.tensor([x], device=p.device), 0.0)
            total = residual.sum()
            if total <= 0:  # p == q exactly: a rejection has probability 0; keep p
                continue
            p = residual / total
        if accepted is None:
            return path, int(sample(p[None], generator))
        node = accepted
        path.append(node)
