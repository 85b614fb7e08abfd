"""One drafting interface over every drafter: MoA, EAGLE-style, independent LM, n-gram lookup
(each kind names its session in vllm_moa/kinds/).

A `DraftSession` follows one sequence through speculative decoding:

    start(prompt, prefill)          the target has run over the prompt (positions 0..P-1)
    propose(pending, spec, sampling, generator) -> DraftTree
                                    a chain or an EAGLE-2 tree (decoding/tree.py) rooted at
                                    `pending`, the target's last token at position `base`, not yet
                                    run through the target
    accept(tree, path, verified)    the target verified the tree and kept the nodes `path` (root
                                    first); `verified` is its output at those nodes ([1, len(path)])

Each session keeps only what its drafter needs. Tree nodes are fed to the drafter level by level
with an ancestor mask; after verification its caches are compacted to the accepted path (cached
K/V of a node depends only on its ancestors, so the kept entries equal a fresh computation) and
only accepted nodes that were never fed are run. EAGLE re-feeds accepted tokens with the target's
true features, as EAGLE does.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.decoding.tree import DraftSpec, DraftTree, grow_tree
from vllm_moa.layers import KVCache, causal_mask_after
from vllm_moa.models import EagleDrafter, IndependentDrafter, MoADrafter
from vllm_moa.target import TargetModel, TargetOutput


class DraftSession(Protocol):
    def start(self, prompt: Tensor, prefill: TargetOutput) -> None: ...

    def propose(self, pending: int, spec: DraftSpec, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> DraftTree: ...

    def accept(self, tree: DraftTree, path: list[int], verified: TargetOutput) -> None: ...


class _ModelSession:
    """Shared proposal loop over `_step` (one tree level; see tree.StepFn)."""

    device: torch.device

    def _begin(self) -> None:
        pass

    def _step(self, tokens: Tensor, depths: list[int], parent_slots: list[int], visible: Tensor) -> Tensor:
        raise NotImplementedError

    def propose(self, pending: int, spec: DraftSpec, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> DraftTree:
        self._begin()
        return grow_tree(self._step, pending, spec, sampling, generator, self.device)


def fed_prefix(tree: DraftTree, path: list[int]) -> list[int]:
    """Feed slots of the accepted nodes the drafter has already run (always a prefix of the path)."""
    slots = []
    for node in path:
        if tree.feed_slots[node] < 0:
            break
        slots.append(tree.feed_slots[node])
    return slots


def keep_index(base: int, slots: list[int], device: torch.device) -> Tensor:
    """Cache positions to keep: the verified prefix 0..base-1, then the accepted fed nodes."""
    return torch.cat([torch.arange(base, device=device), base + torch.tensor(slots, dtype=torch.long, device=device)])


class MoASession(_ModelSession):
    """CA rows of verified tokens + SA KV cache (+ TLI caches), compacted to the accepted path."""

    def __init__(self, drafter: MoADrafter, target: TargetModel) -> None:
        self.drafter, self.target, self.device = drafter, target, target.device
        self.state = drafter.new_state()

    def start(self, prompt: Tensor, prefill: TargetOutput) -> None:
        self.drafter.extend_verified(self.state, prefill.keys, prefill.values)
        self.drafter.feed(self.state, prompt, self.target)

    def _begin(self) -> None:
        self.base = self.state.num_verified  # the root's position; SA holds exactly the verified tokens

    def _step(self, tokens: Tensor, depths: list[int], parent_slots: list[int], visible: Tensor) -> Tensor:
        positions = (self.base + torch.tensor(depths, device=self.device))[None]  # [1, n]
        return self.drafter.draft_step(self.state, tokens[None], self.target, positions, visible)[0]

    def accept(self, tree: DraftTree, path: list[int], verified: TargetOutput) -> None:
        first = len(verified.keys) - self.drafter.tli
        self.accept_rows(tree, path, self.drafter.rows_from_kv(verified.keys, verified.values),
                         verified.keys[first:], verified.values[first:])

    def accept_rows(self, tree: DraftTree, path: list[int], rows: Tensor, tli_keys: list[Tensor],
                    tli_values: list[Tensor]) -> None:
        """`accept` from what a server sends instead of the target's output: the accepted nodes'
        Ekv2E rows [1, n, E] (+ last-TLI-layer K/V), as in serving/."""
        fed = fed_prefix(tree, path)
        self.state.sa.select(keep_index(self.base, fed, self.device))
        self.drafter.extend_rows(self.state, rows, tli_keys, tli_values)  # also drops TLI drafts
        if len(fed) < len(path):  # accepted nodes never run through SA (the last level's leaves)
            self.drafter.feed(self.state, tree.tokens[path[len(fed):]][None].to(self.device), self.target)


class EagleSession(_ModelSession):
    """One decoder layer's KV cache over (token, previous feature) inputs; past the last verified
    token each node feeds on its parent's predicted feature."""

    def __init__(self, drafter: EagleDrafter, target: TargetModel) -> None:
        self.drafter, self.target, self.device = drafter, target, target.device
        self.cache = KVCache()
        self.last_feature: Tensor | None = None  # target's final hidden at the last verified position

    def _run(self, tokens: Tensor, features_in: Tensor, positions: Tensor | None = None,
             mask: Tensor | None = None) -> Tensor:
        """tokens [1, n], features_in [1, n, E] -> predicted features [1, n, E] (default: a chain
        at the next cache positions)."""
        b, n = tokens.shape
        start = self.cache.length
        if positions is None:
            positions = torch.arange(start, start + n, device=tokens.device).expand(b, n)
        if mask is None:
            mask = causal_mask_after(start, n, tokens.device)
        hidden = self.drafter.fc(torch.cat([self.target.embed(tokens), features_in], dim=-1))
        return self.drafter.layer(hidden, positions, mask, self.cache)

    def _feed_verified(self, tokens: Tensor, true_features: Tensor) -> None:
        """Verified tokens [1, n] with the target's features [1, n, E] at the same positions."""
        previous = torch.cat([self.last_feature, true_features[:, :-1]], dim=1)
        self._run(tokens, previous)
        self.last_feature = true_features[:, -1:]

    def start(self, prompt: Tensor, prefill: TargetOutput) -> None:
        self.last_feature = torch.zeros_like(prefill.hidden_states[-1][:, :1])
        self._feed_verified(prompt, prefill.hidden_states[-1])

    def _begin(self) -> None:
        self.base = self.cache.length
        self.features: list[Tensor] = []  # predicted feature of each fed node, by feed slot

    def _step(self, tokens: Tensor, depths: list[int], parent_slots: list[int], visible: Tensor) -> Tensor:
        n = tokens.shape[0]
        features_in = torch.stack([self.last_feature[0, 0] if s < 0 else self.features[s] for s in parent_slots])
        positions = (self.base + torch.tensor(depths, device=self.device))[None]
        mask = torch.cat([torch.ones(n, self.base, dtype=torch.bool, device=self.device), visible], dim=-1)[None, None]
        out = self._run(tokens[None], features_in[None], positions, mask)[0]  # [n, E]
        self.features.extend(out.unbind(0))
        return self.drafter.draft_logits(out, self.target)

    def accept(self, tree: DraftTree, path: list[int], verified: TargetOutput) -> None:
        self.cache.crop(self.base)
        self._feed_verified(tree.tokens[path][None], verified.hidden_states[-1])


class IndependentSession(_ModelSession):
    """A small LM with its own KV caches, compacted to the accepted path."""

    def __init__(self, drafter: IndependentDrafter) -> None:
        self.drafter = drafter
        self.device = next(drafter.parameters()).device
        self.caches = [KVCache() for _ in drafter.layers]

    def start(self, prompt: Tensor, prefill: TargetOutput) -> None:
        self.drafter(prompt, self.caches)

    def _begin(self) -> None:
        self.base = self.caches[0].length

    def _step(self, tokens: Tensor, depths: list[int], parent_slots: list[int], visible: Tensor) -> Tensor:
        n = tokens.shape[0]
        positions = (self.base + torch.tensor(depths, device=self.device))[None]
        mask = torch.cat([torch.ones(n, self.base, dtype=torch.bool, device=self.device), visible], dim=-1)[None, None]
        return self.drafter(tokens[None], self.caches, positions, mask)[0]

    def accept(self, tree: DraftTree, path: list[int], verified: TargetOutput) -> None:
        fed = fed_prefix(tree, path)
        keep = keep_index(self.base, fed, self.device)
        for cache in self.caches:
            cache.select(keep)
        if len(fed) < len(path):
            self.drafter(tree.tokens[path[len(fed):]][None], self.caches)


class NgramSession:
    """Prompt lookup: propose what followed earlier matches of the recent suffix (longest suffix
    first, most recent match first). A chain takes the first match; a tree merges the continuations
    of up to `top_k` distinct matches into a trie of at most `budget` nodes. No match: no draft."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history: list[int] = []

    def start(self, prompt: Tensor, prefill: TargetOutput) -> None:
        self.history = prompt[0].tolist()

    def continuations(self, pending: int, length: int, limit: int) -> list[list[int]]:
        """Up to `limit` distinct continuations (<= `length` tokens) of history + [pending]."""
        tokens = self.history + [pending]
        found: list[list[int]] = []
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + length]
                    if follow and not any(f[: len(follow)] == follow for f in found):
                        found.append(follow)
                        if len(found) == limit:
                            return found
        return found

    def propose(self, pending: int, spec: DraftSpec, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> DraftTree:
        """Deterministic proposals (point masses when sampling)."""
        device = "cpu"
        limit = 1 if spec.is_chain else spec.top_k
        tokens, parents, depths = [pending], [-1], [0]
        trie: dict[tuple[int, int], int] = {}
        for follow in self.continuations(pending, spec.depth, limit):
            node = 0
            for token in follow:
                if (node, token) not in trie:
                    if len(tokens) - 1 >= spec.max_nodes:
                        break
                    tokens.append(token)
                    parents.append(node)
                    depths.append(depths[node] + 1)
                    trie[(node, token)] = len(tokens) - 1
                node = trie[(node, token)]
        return DraftTree(torch.tensor(tokens, device=device), parents, depths, [-1] * len(tokens))

    def accept(self, tree: DraftTree, path: list[int], verified: TargetOutput) -> None:
        self.history += tree.tokens[path].tolist()

