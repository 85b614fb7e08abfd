"""Retrieval drafting and hybrid draft trees: lookup over the sequence so far (prompt lookup /
n-gram), alone or merged into a model drafter's tree.

Lookup and a model draft from different information: lookup copies spans the context already
holds (code, quoted text, repeated names), the model predicts new text. A hybrid round:

    continuations = what followed earlier matches of the recent suffix (longest suffix first,
                    most recent match first; of a few such, the `branches` longest, `depth` tokens
                    at most)
    a continuation at least `alone_at` tokens long  ->  the lookup trie alone: the drafter does not
                    run this round (it catches up on the accepted tokens afterwards)
    otherwise       ->  the model's tree (chain or EAGLE-2 tree), with each continuation merged in
                    as a branch from the root (shared prefixes reuse the model's nodes; at most
                    `extra_nodes` new nodes)

Merged nodes are deterministic (point masses): verified greedily or by recursive rejection
(decoding/verify.py), the output stays exactly the target's, greedy or sampled. A model chain
sampled from the drafter's distribution (temperature > 0) carries that distribution for
rejection sampling, so it is left as drafted (no merge; the retrieval-alone rule still applies).

    Retrieval            the options, declared once
    lookup_options(...)  the entry points' one `lookup` option (on by default) -> Retrieval | None
    continuations(...)   the lookup
    merge_branches(...)  continuations into a tree
    lookup_found / lookup_alone / lookup_merged   one round's lookup, for any drafter (the client's too)
    HybridSession        a model drafter's session + lookup, as one DraftSession
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from vllm_moa.decoding.drafters import ModelSession, accept_all, propose_all
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.decoding.tree import DraftSpec, DraftTree
from vllm_moa.target import TargetOutput


class Retrieval(BaseModel):
    """Lookup merged into a model drafter's tree (SpeculativeEngine(..., retrieval=Retrieval()))."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_ngram: int = Field(4, ge=1, le=64, description="longest suffix looked up")
    min_ngram: int = Field(2, ge=1, le=64, description="shortest suffix looked up (1-token matches are mostly noise "
                                                       "next to a model)")
    branches: int = Field(2, ge=1, le=16, description="distinct continuations merged per round")
    extra_nodes: int | None = Field(None, ge=1, le=64, description="new nodes lookup may add to the model's tree "
                                                                   "(default: the draft depth)")
    alone_at: int | None = Field(None, ge=1, le=64, description="a continuation this long is drafted alone, "
                                                                "without running the model (default: the draft "
                                                                "depth; set above it to always run the model)")

    @model_validator(mode="after")
    def _ngram_range(self) -> Retrieval:
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"retrieval min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")
        return self


def lookup_options(lookup: bool | dict | Retrieval | None, model_free: bool) -> Retrieval | None:
    """The one lookup option of every runtime entry point (Speculator, `vllm-moa generate / demo`,
    the client) -> the Retrieval options, or None (off). True (the default there): Retrieval()
    for model drafters, off for model-free ones (n-gram lookup is lookup already; plain decoding
    drafts nothing); a dict: Retrieval(**dict); False / None: off. Asking a model-free drafter
    for it explicitly (a dict or Retrieval) is refused."""
    if lookup is None or lookup is False:
        return None
    if lookup is True:
        return None if model_free else Retrieval()
    options = lookup if isinstance(lookup, Retrieval) else Retrieval(**lookup)
    if model_free:
        raise ValueError("lookup merges into a model drafter's drafts; this drafter has no model (n-gram lookup "
                         "drafts by lookup alone, 'none' drafts nothing)")
    return options


def continuations(history: Sequence[int], pending: int, max_ngram: int, min_ngram: int, length: int,
                  limit: int) -> list[list[int]]:
    """Up to `limit` distinct continuations (<= `length` tokens each) of history + [pending]: what
    followed earlier occurrences of its last n tokens, n from max_ngram down to min_ngram, the most
    recent occurrence first. A continuation that is a prefix of one already found is skipped."""
    tokens = list(history) + [pending]
    found: list[list[int]] = []
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + length]
                if follow and not any(f[: len(follow)] == follow for f in found):
                    found.append(follow)
                    if len(found) == limit:
                        return found
    return found


def merge_branches(tree: DraftTree, branches: Sequence[Sequence[int]], max_new: int) -> DraftTree:
    """`tree` with each branch (tokens after the root) added as a path from the root: existing
    nodes with the same token under the same parent are reused, at most `max_new` nodes are added
    (a branch cut there keeps its prefix). New nodes are appended (parents first), never fed to a
    drafter (feed slot -1) and deterministic (the result has no draft probabilities)."""
    tokens, parents = tree.tokens.tolist(), list(tree.parents)
    depths, slots = list(tree.depths), list(tree.feed_slots)
    child = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
    added = 0
    for branch in branches:
        node = 0
        for token in branch:
            if (node, token) not in child:
                if added >= max_new:
                    break
                tokens.append(token)
                parents.append(node)
                depths.append(depths[node] + 1)
                slots.append(-1)
                child[(node, token)] = len(tokens) - 1
                added += 1
            node = child[(node, token)]
    if added == 0:
        return tree
    return DraftTree(torch.tensor(tokens, device=tree.tokens.device), parents, depths, slots)


def lookup_found(options: Retrieval, history: Sequence[int], pending: int, spec: DraftSpec) -> list[list[int]]:
    """The round's continuations of history + [pending]: of a few candidates, the `branches`
    longest (in a run, the most recent match is the shortest one; stable: recency among equals)."""
    found = continuations(history, pending, options.max_ngram, options.min_ngram, spec.depth, 4 * options.branches)
    return sorted(found, key=len, reverse=True)[: options.branches]


def lookup_alone(options: Retrieval, pending: int, spec: DraftSpec, found: list[list[int]],
                 device: torch.device | None = None) -> DraftTree | None:
    """The lookup trie alone when a continuation is long enough (the model need not draft), else None."""
    if not found or len(found[0]) < (options.alone_at or spec.depth):
        return None
    return merge_branches(DraftTree.single(pending, device), found, spec.max_nodes)


def lookup_merged(options: Retrieval, tree: DraftTree, found: list[list[int]], spec: DraftSpec,
                  max_new: int | None = None) -> DraftTree | None:
    """The model's tree with the continuations merged in (at most `extra_nodes`, and `max_new`, new
    nodes), or None when there is nothing to merge or the tree is a sampled chain (its q is kept
    for rejection sampling)."""
    if not found or tree.probs is not None or (max_new is not None and max_new < 1):
        return None
    extra = options.extra_nodes or spec.depth
    return merge_branches(tree, found, extra if max_new is None else min(extra, max_new))


class HybridSession:
    """A model drafter's session (decoding/drafters.ModelSession) with lookup merged into its
    trees. Counts its rounds by source in `rounds`: "model", "merged", "retrieval"."""

    def __init__(self, model: ModelSession, retrieval: Retrieval) -> None:
        if not isinstance(model, ModelSession):
            raise ValueError("retrieval merges lookup into a model drafter's tree; this drafter has no model "
                             f"session ({type(model).__name__}): use it without retrieval")
        self.model, self.retrieval = model, retrieval
        self.history: list[int] = []
        self.rounds = {"model": 0, "merged": 0, "retrieval": 0}

    @property
    def starts_from_suffix(self) -> bool:
        return getattr(self.model, "starts_from_suffix", False)

    def start(self, prompt: Tensor, prefill: TargetOutput) -> None:
        self.model.start(prompt, prefill)  # the model reads what prefill covers; lookup the whole prompt
        self.history = prompt[0].tolist()

    def propose(self, pending: int, spec: DraftSpec, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> DraftTree:
        found = self._lookup(pending, spec)
        alone = self._alone(pending, spec, found)
        return alone or self._merge(self.model.propose(pending, spec, sampling, generator), found, spec)

    def _lookup(self, pending: int, spec: DraftSpec) -> list[list[int]]:
        return lookup_found(self.retrieval, self.history, pending, spec)

    def _alone(self, pending: int, spec: DraftSpec, found: list[list[int]]) -> DraftTree | None:
        """The lookup trie when a continuation is long enough to draft alone (the model skips the round)."""
        tree = lookup_alone(self.retrieval, pending, spec, found, self.model.device)
        if tree is not None:
            self.model.skip_round()
            self.rounds["retrieval"] += 1
        return tree

    def _merge(self, tree: DraftTree, found: list[list[int]], spec: DraftSpec) -> DraftTree:
        merged = lookup_merged(self.retrieval, tree, found, spec)
        self.rounds["model" if merged is None else "merged"] += 1
        return tree if merged is None else merged

    def accept(self, tree: DraftTree, path: list[int], verified: TargetOutput) -> None:
        self.model.accept(tree, path, verified)
        self.history += tree.tokens[path].tolist()

    def skip_round(self) -> None:
        self.model.skip_round()

    # -- a batch's sequences together (drafters.propose_all / accept_all): lookup per sequence,
    # the model for those that need it in one batch --------------------------------------------
    def batch_key(self) -> object | None:
        key = self.model.batch_key()
        return None if key is None else ("hybrid", key)

    @classmethod
    def propose_batch(cls, sessions: Sequence[HybridSession], pendings: Sequence[int], spec: DraftSpec,
                      sampling: SamplingParams | None, generator: torch.Generator | None) -> list[DraftTree]:
        found = [s._lookup(p, spec) for s, p in zip(sessions, pendings)]
        trees = [s._alone(p, spec, f) for s, p, f in zip(sessions, pendings, found)]
        drafting = [i for i, tree in enumerate(trees) if tree is None]
        if drafting:
            drafted = propose_all([sessions[i].model for i in drafting], [pendings[i] for i in drafting], spec,
                                  sampling, generator)
            for i, tree in zip(drafting, drafted):
                trees[i] = sessions[i]._merge(tree, found[i], spec)
        return trees

    @classmethod
    def accept_batch(cls, sessions: Sequence[HybridSession], trees: Sequence[DraftTree], paths: Sequence[list[int]],
                     verified: Sequence[TargetOutput]) -> None:
        accept_all([s.model for s in sessions], trees, paths, verified)
        for session, tree, path in zip(sessions, trees, paths):
            session.history += tree.tokens[path].tolist()


def max_extra_nodes(retrieval: Retrieval | None, spec: DraftSpec) -> int:
    """Nodes a round may hold beyond spec.max_nodes (the context-window check)."""
    return 0 if retrieval is None else (retrieval.extra_nodes or spec.depth)
