"""Lookup drafts beside MoA's inside vLLM (speculative_config "moa_retrieval", the options of
decoding/retrieval.Retrieval).

Each step, for each request of the batch, the continuations of its sequence so far
(decoding.retrieval.continuations: what followed earlier matches of its last n tokens). A request
whose longest continuation is at least `alone_at` tokens long (default: the chain's K, or the
tree's depth) drafts from lookup this step:

    chain   the continuation's first K tokens (a shorter one repeats its last token up to K)
    tree    up to `branches` continuations merged from the root, within the node budget
            (num_speculative_tokens; pad_tree fills what is left)

When every request of the batch drafts from lookup, the drafter runs only its first pass (which
keeps its own KV cache in step with the sequence, as vLLM's dynamic K = 0 does) and no drafting
step; otherwise the model drafts for the batch and the lookup rows replace its drafts.

Lookup drafts are point masses: greedy verification accepts exactly the target's own tokens;
vLLM's rejection sampler (chains: one-hot draft probabilities where the model's chains carry q)
and tree acceptance (deterministic nodes) keep sampling at temperature > 0 exact.

No vLLM import here: the proposer hands in plain token lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from vllm_moa.decoding.retrieval import Retrieval, continuations, merge_branches
from vllm_moa.decoding.tree import DraftTree


@dataclass
class LookupPlan:
    """One step's lookups: found[b] = row b's continuations (longest first) when it drafts from
    lookup this step, else None."""

    found: list[list[list[int]] | None]

    @property
    def rows(self) -> list[int]:
        return [b for b, found in enumerate(self.found) if found is not None]

    @property
    def every_row(self) -> bool:
        return bool(self.found) and all(found is not None for found in self.found)


def plan_lookups(options: Retrieval, histories: Sequence[Sequence[int]], pendings: Sequence[int], length: int,
                 alone_at: int) -> LookupPlan:
    """Which rows draft from lookup: a continuation (<= `length` tokens) of history + [pending]
    at least `options.alone_at or alone_at` tokens long."""
    threshold = options.alone_at or alone_at
    plan: list[list[list[int]] | None] = []
    for history, pending in zip(histories, pendings, strict=True):
        found = continuations(history, pending, options.max_ngram, options.min_ngram, length, 4 * options.branches)
        found = sorted(found, key=len, reverse=True)[: options.branches]  # stable: recency among equals
        plan.append(found if found and len(found[0]) >= threshold else None)
    return LookupPlan(plan)


def lookup_chain(found: list[list[int]], count: int) -> list[int]:
    """The chain of `count` tokens drafted from the longest continuation."""
    best = found[0][:count]
    return best + [best[-1]] * (count - len(best))


def lookup_tree(pending: int, found: list[list[int]], budget: int) -> DraftTree:
    """The tree drafted from lookup: the continuations as paths from the root, <= `budget` nodes."""
    return merge_branches(DraftTree.single(pending), found, budget)


def request_histories(verified: Sequence[Sequence[int]], scheduled_drafts: Sequence[int], step_tokens: Sequence[int],
                      query_start: Sequence[int], rejected: Sequence[int] | None) -> list[list[int]]:
    """Each row's tokens so far, before the token the target just sampled (the pending one).

    verified[b]: the tokens vLLM held before this step (prompt + outputs; ends with the token this
    step verified from); scheduled_drafts[b]: the draft tokens it scheduled for row b this step;
    step_tokens / query_start: the step's input ids [N] and row offsets [B + 1] (after a tree's
    accepted path was moved to the front, integration/moa/tree_verification.py); rejected[b]: the drafts rejected
    (None: vLLM already trimmed them from the rows). The accepted drafts follow the verified tokens."""
    histories = []
    for b, tokens in enumerate(verified):
        in_row = query_start[b + 1] - query_start[b] - 1
        accepted = max(0, min(in_row, scheduled_drafts[b]) - (rejected[b] if rejected is not None else 0))
        start = query_start[b] + 1
        histories.append(list(tokens) + list(step_tokens[start: start + accepted]))
    return histories


def one_hot_rows(probs: Tensor, rows: Sequence[int], chains: Tensor) -> None:
    """Draft probabilities [B, K, V] of lookup rows become point masses at their tokens, in place
    (q for vLLM's rejection sampler: a lookup draft was not sampled from the model)."""
    for b in rows:
        probs[b].zero_()
        probs[b].scatter_(-1, chains[b].unsqueeze(-1).to(device=probs.device, dtype=torch.long), 1.0)


class LookupDrafting:
    """One proposer's lookup drafts: each step's plan and the chains that replace the model's.
    `rounds`: request-steps drafted by each source (model / retrieval), for the counters."""

    def __init__(self, options: Retrieval, tree_depth: int | None) -> None:
        self.options = options
        self.tree_depth = tree_depth  # None: chains (a lookup drafts alone from K tokens on)
        self.rounds = {"model": 0, "retrieval": 0}

    def plan(self, view: Any, step_tokens: Tensor, next_token_ids: Tensor, query_start_loc: list[int],
             num_rejected: Tensor | None, count: int) -> LookupPlan:
        """Which requests draft from lookup this step. view: RunnerView (verified tokens and
        scheduled drafts per row); step_tokens [N]; next_token_ids [B]; count: K or the tree's budget."""
        batch = next_token_ids.shape[0]
        histories = request_histories(
            [view.verified_token_ids(b) for b in range(batch)], [view.scheduled_draft_count(b) for b in range(batch)],
            step_tokens.tolist(), query_start_loc[: batch + 1], None if num_rejected is None else num_rejected.tolist())
        alone_at = count if self.tree_depth is None else self.tree_depth  # a tree's paths may be as deep as its budget
        plan = plan_lookups(self.options, histories, next_token_ids.tolist(), count, alone_at)
        drafted = len(plan.rows)
        self.rounds["retrieval"] += drafted
        self.rounds["model"] += batch - drafted
        return plan

    @staticmethod
    def chains(drafts: Tensor, plan: LookupPlan, count: int, draft_probs: Tensor | None,
               device: torch.device) -> tuple[Tensor, Tensor | None]:
        """The model's chains [B, K] with the lookup rows' chains in their place, and the draft
        probabilities [B, K, V] for vLLM's rejection sampler (lookup rows: point masses; None when
        every row is a lookup)."""
        if not plan.rows:
            return drafts, draft_probs
        chains = torch.tensor([lookup_chain(found, count) if found is not None else [0] * count
                               for found in plan.found], dtype=torch.long)  # [B, K]
        if plan.every_row:
            return chains.to(device), None
        drafts = drafts.clone()
        rows = plan.rows
        drafts[rows] = chains[rows].to(drafts.device, drafts.dtype)
        if draft_probs is not None:  # q of the model's sampled chains: lookup rows are point masses
            one_hot_rows(draft_probs, rows, chains)
        return drafts, draft_probs
