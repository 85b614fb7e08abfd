"""Draft trees that run no slower than the chain of their budget: `"moa_tree": {"depth": 3,
"top_k": 2}` (`"chain_if_faster": true` by default; false drafts the tree at every step).

A tree of B nodes accepts more per step than the chain of B tokens, but its step costs more: on
vLLM's CPU engine the target recomputes the tree nodes' rows under the tree mask in every layer
and the step carries the tree's bookkeeping, while a chain is verified by vLLM alone. At small
budgets the chain is then faster (SmolLM2, B = 4: the tree accepts 2.3% more and its step takes
10-25% longer); at large ones the tree is (a chain of 16 is rarely accepted that far). Which side
of that line a setup falls on depends on the machine, the target, the drafter and the load, so
the proposer measures it: each step drafts either the tree or the chain of
B tokens (grown through the same tree levels with top_k = 1: a chain-shaped tree, which vLLM
verifies as a chain with no tree step), whichever has measured more tokens per second at the
step's batch size (decoding/speed_control.FasterShape: both tried first, the other re-tried now
and then).

A step is timed from one proposal to the next (drafting, the target's forward, sampling, the
scheduler); its tokens are every request's accepted drafts + 1. A step is measured only if it
verified the full B drafts of every request of the previous proposal and no other request (no
prefill chunk, no request joining or leaving, no schedule cut short): otherwise its time says
nothing about the shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from vllm_moa.decoding.speed_control import FasterShape
from vllm_moa.decoding.tree import DraftSpec

TREE, CHAIN = "tree", "chain"


class TreeOrChain:
    """Per step: the tree `tree` or the chain of `budget` tokens, whichever measures faster."""

    def __init__(self, tree: DraftSpec, budget: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.specs = {TREE: tree, CHAIN: DraftSpec(depth=budget, top_k=1, budget=budget)}
        self.budget, self.clock = budget, clock
        self.choice = FasterShape([TREE, CHAIN])
        self._last: tuple[float, str, list] | None = None  # (when, shape, request ids) of the last proposal

    def next_spec(self, req_ids: list, query_lens: list[int], num_rejected: list[int] | None) -> DraftSpec:
        """Called as a step's proposal begins, with the batch's request ids, the tokens each
        request verified in the step just run (query_lens: root + drafts) and the drafts rejected:
        prices the last proposal's shape, then picks this one's."""
        now = self.clock()
        if self._last is not None and num_rejected is not None:
            started, shape, previous = self._last
            if list(req_ids) == previous and all(q == self.budget + 1 for q in query_lens):
                tokens = sum(q - r for q, r in zip(query_lens, num_rejected, strict=True))
                self.choice.observe(len(previous), shape, tokens, now - started)
        shape = self.choice.choose(len(req_ids))
        self._last = (now, shape, list(req_ids))
        return self.specs[shape]
