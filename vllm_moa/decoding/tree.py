"""Draft trees: the one shape every proposal takes (a chain is a tree of breadth 1), their
EAGLE-2-style dynamic growth, and the masks that let the target verify a tree in one forward.

Node 0 is the root: the target's last chosen token (`pending`), not yet run through the target.
Nodes are ordered so that every parent comes before its children; node i sits at position
base + depth[i], where base is the root's position.

Growth (docs/method.md section 3, EAGLE-2): the drafter runs over the current frontier, each
frontier node proposes its `top_k` most likely children, a child's score is its path
log-probability (parent's score + log q), and the `top_k` best children of the level become the
next frontier; after `depth` levels the `budget` best nodes by score are kept. Scores never rise
along a path, so the kept set is closed under ancestors. Chains skip the scoring: greedy takes the
argmax, sampling draws each child from the drafter's warped distribution q (kept for rejection
sampling). Tree children are always the deterministic top-k: verified by recursive rejection with
point-mass proposals (decoding/verify.py), that stays lossless whatever the tree's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_moa.decoding.sampling import SamplingParams, sample


@dataclass(frozen=True)
class DraftSpec:
    """What to draft each round: a chain of `depth` tokens (top_k = 1, no budget), or an EAGLE-2
    tree of at most `budget` drafted nodes grown `depth` levels deep, `top_k` wide."""

    depth: int = 4
    top_k: int = 1
    budget: int | None = None

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"draft depth (num_draft) must be >= 1, got {self.depth}")
        if self.top_k < 1:
            raise ValueError(f"tree top_k must be >= 1, got {self.top_k}")
        if self.budget is not None:
            if self.budget < 1:
                raise ValueError(f"tree budget must be >= 1, got {self.budget}")
            if self.budget > self.most_drafted:
                raise ValueError(f"tree budget {self.budget} exceeds the {self.most_drafted} nodes that "
                                 f"depth={self.depth}, top_k={self.top_k} can draft")

    @classmethod
    def chain(cls, num_draft: int) -> DraftSpec:
        return cls(depth=num_draft)

    @classmethod
    def tree(cls, depth: int = 5, top_k: int = 4, budget: int = 16) -> DraftSpec:
        return cls(depth=depth, top_k=top_k, budget=budget)

    @property
    def is_chain(self) -> bool:
        return self.top_k == 1 and self.budget in (None, self.depth)

    @property
    def most_drafted(self) -> int:
        """Nodes the growth can draft: top_k children of the root, then top_k^2 per further level."""
        return self.depth if self.top_k == 1 else self.top_k + (self.depth - 1) * self.top_k ** 2

    @property
    def max_nodes(self) -> int:
        """Drafted nodes per round at most (root excluded): the target verifies max_nodes + 1."""
        return self.depth if self.is_chain else min(self.budget or self.most_drafted, self.most_drafted)

    def describe(self) -> str:
        return f"chain K={self.depth}" if self.is_chain else f"tree depth={self.depth} top_k={self.top_k} budget={self.budget}"


DEFAULT_TREE = DraftSpec.tree()  # the runtime's, the API's and the demo's default draft


@dataclass
class DraftTree:
    """tokens [N] (node 0 = root); parents[i] < i (-1 for the root); depths[i] = depth below the root;
    feed_slots[i]: where the drafter's caches hold node i in this round's drafted region, in feeding
    order (-1: never fed); probs [N, V]: the q node i was sampled from (None: deterministic nodes)."""

    tokens: Tensor
    parents: list[int]
    depths: list[int]
    feed_slots: list[int]
    probs: Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def is_chain(self) -> bool:
        """Every node the child of the one before it (a lone root included)."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self) -> list[list[int]]:
        """Each node's children, in node order (the order acceptance tries them)."""
        out: list[list[int]] = [[] for _ in range(self.size)]
        for i in range(1, self.size):
            out[self.parents[i]].append(i)
        return out

    def path_to(self, node: int) -> list[int]:
        """Root ... node."""
        path = [node]
        while self.parents[path[-1]] >= 0:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def ancestor_mask(self) -> Tensor:
        """[N, N] bool: node i may attend node j iff j is i or one of its ancestors."""
        mask = torch.eye(self.size, dtype=torch.bool)
        for i in range(1, self.size):
            mask[i] |= mask[self.parents[i]]
        return mask

    @classmethod
    def single(cls, pending: int, device: torch.device | str = "cpu") -> DraftTree:
        """Nothing drafted: the target just runs the pending token (plain decoding round)."""
        return cls(torch.tensor([pending], device=device), [-1], [0], [-1])

    @classmethod
    def chain(cls, pending: int, drafts: list[int], device: torch.device | str = "cpu",
              fed: int | None = None, probs: Tensor | None = None) -> DraftTree:
        """A chain root -> d_1 -> ... -> d_k; the first `fed` nodes were fed to the drafter in order."""
        n = len(drafts) + 1
        fed = n - 1 if fed is None else fed
        return cls(torch.tensor([pending] + drafts, device=device), list(range(-1, n - 1)), list(range(n)),
                   [i if i < fed else -1 for i in range(n)], probs)


def depths_from_parents(parents: list[int]) -> list[int]:
    """Each node's depth below the root, from a parents-first parent list (parents[0] = -1)."""
    depths: list[int] = []
    for i, parent in enumerate(parents):
        if (i == 0) != (parent == -1) or parent >= i:
            raise ValueError(f"not a parents-first tree: node {i}'s parent is {parent}")
        depths.append(0 if parent == -1 else depths[parent] + 1)
    return depths


# step(tokens [n], depths [n], parent_slots [n], visible [n, F + n]) -> logits [n, V]
# visible[r]: which of this round's drafted-region entries (F fed so far, then these n) node r sees.
StepFn = Callable[[Tensor, list[int], list[int], Tensor], Tensor]


def grow_tree(step: StepFn, pending: int, spec: DraftSpec, sampling: SamplingParams | None,
              generator: torch.Generator | None, device: torch.device) -> DraftTree:
    """Draft one round with a model drafter whose one-level forward is `step`."""
    growth = TreeGrowth(pending, spec, sampling, generator, device)
    while (level := growth.next_level()) is not None:
        growth.advance(step(*level))
    return growth.result()


class TreeGrowth:
    """One round's growth, a level at a time, so that a caller can run the drafter over the
    levels of many sequences in one forward (vLLM's proposer) or over one (grow_tree):

        growth = TreeGrowth(pending, spec, sampling, generator, device)
        while (level := growth.next_level()) is not None:   # (tokens, depths, parent_slots, visible)
            growth.advance(logits)                           # the drafter's logits [n, V] for them
        tree = growth.result()
    """

    def __init__(self, pending: int, spec: DraftSpec, sampling: SamplingParams | None,
                 generator: torch.Generator | None, device: torch.device) -> None:
        self.spec, self.sampling, self.generator, self.device = spec, sampling, generator, device
        self.stochastic_chain = spec.is_chain and sampling is not None and not sampling.greedy
        self.tokens, self.parents, self.depths, self.slots = [pending], [-1], [0], [-1]
        self.scores = [0.0]
        self.seen: list[list[int]] = [[]]  # fed slots of each node's ancestors
        self.probs: list[Tensor | None] = [None]
        self.frontier, self.fed, self.levels = [0], 0, 0

    def next_level(self) -> tuple[Tensor, list[int], list[int], Tensor] | None:
        """The frontier to run through the drafter: StepFn's arguments, or None when grown."""
        if not self.frontier or self.levels == self.spec.depth:
            return None
        n = len(self.frontier)
        visible = torch.zeros(n, self.fed + n, dtype=torch.bool, device=self.device)
        for r, node in enumerate(self.frontier):
            visible[r, self.seen[node]] = True
            visible[r, self.fed + r] = True
        parent_slots = [self.slots[self.parents[node]] if self.parents[node] >= 0 else -1 for node in self.frontier]
        tokens = torch.tensor([self.tokens[i] for i in self.frontier], device=self.device)
        return tokens, [self.depths[i] for i in self.frontier], parent_slots, visible

    def advance(self, logits: Tensor) -> None:
        """The drafter's logits [n, V] for the level next_level() gave."""
        spec, frontier = self.spec, self.frontier
        for r, node in enumerate(frontier):
            self.slots[node] = self.fed + r
        self.fed += len(frontier)
        self.levels += 1
        grown = (self.tokens, self.parents, self.depths, self.slots, self.scores, self.seen)
        if spec.is_chain:
            node = frontier[0]
            if self.stochastic_chain:
                q = self.sampling.probs(logits[:1])  # [1, V]
                token = int(sample(q, self.generator))
                self.probs.append(q[0])
            else:
                token = int(logits[0].argmax())
                self.probs.append(None)
            self.frontier = [_add(*grown, node, token, 0.0)]
            return
        sampling = self.sampling
        logq = torch.log_softmax(logits.float(), dim=-1) if sampling is None or sampling.greedy \
            else sampling.probs(logits).log()
        top = logq.topk(spec.top_k, dim=-1)
        children: list[int] = []
        for r, node in enumerate(frontier):
            for value, token in zip(top.values[r].tolist(), top.indices[r].tolist()):
                if value == float("-inf"):
                    continue  # outside the warped support: the target could never accept it
                children.append(_add(*grown, node, token, value))
                self.probs.append(None)
        self.frontier = sorted(children, key=lambda i: -self.scores[i])[: spec.top_k]

    def result(self) -> DraftTree:
        tokens, device = self.tokens, self.device
        if self.spec.is_chain:
            prob_tensor = torch.stack(self.probs[1:]) if self.stochastic_chain else None
            if prob_tensor is not None:
                prob_tensor = torch.cat([torch.zeros_like(prob_tensor[:1]), prob_tensor])
            return DraftTree(torch.tensor(tokens, device=device), self.parents, self.depths, self.slots, prob_tensor)
        return _select(tokens, self.parents, self.depths, self.slots, self.scores,
                       self.spec.budget or len(tokens) - 1, device)


def _add(tokens, parents, depths, slots, scores, seen, parent: int, token: int, logq: float) -> int:
    tokens.append(token)
    parents.append(parent)
    depths.append(depths[parent] + 1)
    slots.append(-1)
    scores.append(scores[parent] + logq)
    seen.append(seen[parent] + [slots[parent]])
    return len(tokens) - 1


def _select(tokens, parents, depths, slots, scores, budget: int, device) -> DraftTree:
    """Keep the root and the `budget` best-scoring nodes, re-indexed parents-first."""
    ranked = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], depths[i], i))[:budget]
    keep = [0] + sorted(ranked, key=lambda i: (depths[i], i))
    index = {old: new for new, old in enumerate(keep)}
    missing = [i for i in keep[1:] if parents[i] not in index]
    assert not missing, f"tree selection is not closed under ancestors: {missing}"
    return DraftTree(torch.tensor([tokens[i] for i in keep], device=device),
                     [index[parents[i]] if parents[i] >= 0 else -1 for i in keep],
                     [depths[i] for i in keep], [slots[i] for i in keep])


def verification_inputs(trees: list[DraftTree], lengths: list[int], width: int,
                        device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Batch the trees of B sequences for one target forward over a slot cache.

    Sequence b's cache holds lengths[b] tokens; its N_b nodes are written at slots
    lengths[b] .. lengths[b] + N_b - 1 (padded to N = max N_b). Returns
      input_ids [B, N], positions [B, N], mask [B, 1, N, width]
    where width >= max(lengths) + N columns of the cache are visible to the forward. A node sees
    its sequence's cached prefix and its own ancestors; padding sees only itself.
    """
    n = max(tree.size for tree in trees)
    b = len(trees)
    input_ids = torch.zeros(b, n, dtype=torch.long, device=device)
    positions = torch.zeros(b, n, dtype=torch.long, device=device)
    mask = torch.zeros(b, 1, n, width, dtype=torch.bool, device=device)
    for row, (tree, length) in enumerate(zip(trees, lengths)):
        size = tree.size
        input_ids[row, :size] = tree.tokens
        positions[row, :size] = length + torch.tensor(tree.depths, device=device)
        positions[row, size:] = length
        mask[row, 0, :, :length] = True
        mask[row, 0, :size, length : length + size] = tree.ancestor_mask().to(device)
        pad = torch.arange(size, n, device=device)
        mask[row, 0, pad, length + pad] = True
    return input_ids, positions, mask
