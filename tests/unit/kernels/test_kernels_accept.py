"""Tree acceptance: Triton kernels against their twins (exact: integer outputs), the greedy twin
against a brute-force walk, and the sampling twin's losslessness (Monte Carlo)."""

from __future__ import annotations

import pytest
import torch

from kernel_env import device, no_kernel_env_override  # noqa: F401  (fixtures, TRITON_INTERPRET)

pytest.importorskip("triton")

from vllm_moa.kernels import (  # noqa: E402
    tree_accept_greedy,
    tree_accept_greedy_reference,
    tree_accept_greedy_triton,
    tree_accept_sampling,
    tree_accept_sampling_reference,
    tree_accept_sampling_triton,
    tree_ancestor_masks,
)

TREES = [
    [-1],  # root only
    [-1, 0, 1, 2, 3, 4],  # chain
    [-1] + [0] * 63,  # full width
    [-1, 0, 0, 1, 1, 2, 3, 3, 5, 8],
    list(range(-1, 63)),  # 64-deep chain
    [],  # empty
]


def batch(trees, device):
    sizes = [len(t) for t in trees]
    cu = torch.tensor([0] + sizes).cumsum(0)
    parents = torch.tensor(sum(trees, []), dtype=torch.int64)
    return parents.to(device), cu.to(device), tree_ancestor_masks(parents, cu).to(device), sizes


def assert_same(a, b):
    for name, x, y in zip(a._fields, a, b):
        assert torch.equal(x.cpu(), y.cpu()), name


def brute_force_greedy(tree, draft, target):
    """Walk down from the root, following the first matching child at each level; then compare
    the depth with the best over all root paths."""
    n = len(tree)
    best, best_depth = 0, 0
    for i in range(n):
        path, j = [], i
        while j > 0:
            path.append(j)
            j = tree[j]
        if all(draft[k] == target[tree[k]] for k in path) and (len(path) > best_depth):
            best, best_depth = i, len(path)
    return best, best_depth


@pytest.mark.parametrize("seed", range(4))
def test_greedy_matches_twin_and_brute_force(seed, device):
    g = torch.Generator().manual_seed(seed)
    parents, cu, masks, sizes = batch(TREES, device)
    total, vocab = int(cu[-1]), 3
    draft = torch.randint(0, vocab, (total,), generator=g)
    target = torch.randint(0, vocab, (total,), generator=g)
    if seed == 3:  # everything matches: the deepest nodes win
        for b, tree in enumerate(TREES):
            lo = int(cu[b])
            for i in range(1, len(tree)):
                draft[lo + i] = target[lo + tree[i]]
    draft, target = draft.to(device), target.to(device)
    got = tree_accept_greedy_triton(draft, target, parents, masks, cu)
    want = tree_accept_greedy_reference(draft, target, parents, masks, cu)
    assert_same(got, want)
    for b, tree in enumerate(TREES):
        if not tree:
            assert (want.num_accepted[b], want.best_node[b], want.bonus_token[b]) == (0, -1, -1)
            continue
        lo = int(cu[b])
        best, depth = brute_force_greedy(tree, draft[lo:].tolist(), target[lo:].tolist())
        assert (int(want.best_node[b]), int(want.num_accepted[b])) == (best, depth)
        assert int(want.bonus_token[b]) == int(target[lo + best])
        path = want.path[b, :depth + 1].tolist()
        assert path[0] == 0 and path[-1] == best and all(tree[c] == p for p, c in zip(path, path[1:]))
        assert (want.path[b, depth + 1:] == -1).all()
    if seed == 3:
        assert want.num_accepted.tolist() == [0, 5, 1, 4, 63, 0]


@pytest.mark.parametrize("seed", range(3))
def test_sampling_matches_twin(seed, device):
    g = torch.Generator().manual_seed(seed)
    trees = TREES + [[-1, 0, 0, 0, 1, 1, 2, 4]]
    parents, cu, masks, sizes = batch(trees, device)
    total, vocab = int(cu[-1]), 300  # > one BLOCK_V chunk under the interpreter
    target_probs = torch.softmax(2 * torch.randn(total, vocab, generator=g), -1)
    draft_probs = torch.softmax(2 * torch.randn(total, vocab, generator=g), -1)
    if seed == 1:  # a perfect drafter accepts everything
        draft_probs = target_probs.clone()
    start = torch.repeat_interleave(cu[:-1].cpu(), torch.tensor(sizes))
    rows = start + parents.cpu().clamp(min=0)
    draft = torch.multinomial(draft_probs[rows], 1, generator=g).flatten()
    uniforms = torch.rand(total, generator=g)
    bonus_uniforms = torch.rand(len(trees), generator=g)
    args = [t.to(device) for t in (draft, parents, cu, target_probs, draft_probs, uniforms, bonus_uniforms)]
    got = tree_accept_sampling_triton(*args)
    want = tree_accept_sampling_reference(*args)
    assert_same(got, want)
    if seed == 1:
        deepest = [0, 5, 1, 3, 63, 0, 3]  # with p == q the first child is always accepted
        assert want.num_accepted.tolist() == deepest


def test_sampling_is_lossless():
    """Monte Carlo on the twin: a root with 3 i.i.d. drafted children; the first emitted token
    (the accepted child, or the bonus) must follow the target distribution."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    tree = torch.tensor([-1, 0, 0, 0])
    cu = torch.tensor([0, 4])
    probs_p, probs_q = p.expand(4, 4), q.expand(4, 4)
    trials = 3000
    counts = torch.zeros(4)
    for _ in range(trials):
        draft = torch.multinomial(q, 3, replacement=True, generator=g)
        draft = torch.cat([torch.zeros(1, dtype=torch.int64), draft])
        res = tree_accept_sampling_reference(draft, tree, cu, probs_p, probs_q, torch.rand(4, generator=g),
                                             torch.rand(1, generator=g))
        first = int(draft[res.path[0, 1]]) if res.num_accepted[0] > 0 else int(res.bonus_token[0])
        counts[first] += 1
    freq = counts / trials
    assert torch.allclose(freq, p, atol=0.03), freq


def test_sampling_with_one_hot_target_is_greedy():
    """A one-hot target (temperature 0) and a uniform drafter: with uniforms just below 1 a child
    is accepted iff it is the target's token, and every residual is the target's token: greedy."""
    parents, cu, masks, sizes = batch(TREES[:4], "cpu")
    total, vocab = int(cu[-1]), 5
    g = torch.Generator().manual_seed(7)
    target = torch.randint(0, vocab, (total,), generator=g)
    draft = torch.randint(0, vocab, (total,), generator=g)
    p = torch.nn.functional.one_hot(target, vocab).float()
    q = torch.full((total, vocab), 1.0 / vocab)
    sampled = tree_accept_sampling_reference(draft, parents, cu, p, q, torch.full((total,), 0.999),
                                             torch.full((4,), 0.5))
    assert_same(sampled, tree_accept_greedy_reference(draft, target, parents, masks, cu))


def test_dispatch(device, monkeypatch):
    parents, cu, masks, _ = batch(TREES[:2], device)
    total = int(cu[-1])
    draft = torch.zeros(total, dtype=torch.int64, device=device)
    target = torch.zeros(total, dtype=torch.int64, device=device)
    monkeypatch.setenv("VLLM_MOA_KERNELS", "triton")
    got = tree_accept_greedy(draft, target, parents, masks, cu)
    assert got.num_accepted.tolist() == [0, 5]
    p = torch.full((total, 4), 0.25, device=device)
    args = (draft, parents, cu, p, p, torch.rand(total, device=device), torch.rand(2, device=device))
    assert_same(tree_accept_sampling(*args), tree_accept_sampling(*args, backend="torch"))


def test_rejects_bad_trees():
    parents = torch.tensor([-1, 2, 0])
    cu = torch.tensor([0, 3])
    with pytest.raises(ValueError, match="topological"):
        tree_accept_greedy_reference(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), parents,
                                     tree_ancestor_masks(parents, cu), cu)
