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
    skip_round()                    this round's tree does not come from propose (plain decoding,
                                    or lookup): accept() follows as usual

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
from vllm_moa.target import TargetOutput


class DraftSession(Protocol):
    def start(self, prompt: Tensor, prefill: TargetOutput) -> None: ...

    def propose(self, pending: int, spec: DraftSpec, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> DraftTree: ...

    def accept(self, tree: DraftTree, path: list[int], verified: TargetOutput) -> None: ...

    def skip_round(self) -> None: ...


class ModelSession:
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

    def skip_round(self) -> None:
        """This round's draft comes from elsewhere (lookup: retrieval.HybridSession, or none: a plain
        round): nothing is fed, and accept() then runs the drafter over the accepted tokens as over
        a round's unfed leaves."""
        self._begin()


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
