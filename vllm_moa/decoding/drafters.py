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

A round over a batch of sequences goes through `propose_all` / `accept_all`: sessions of a kind
that drafts in batches (`ModelSession.batch_key`; MoA TLI=0) run one drafter forward per tree
level for all sequences and one LSA call for all accepted rows; any other session drafts alone.

Each session keeps only what its drafter needs. Tree nodes are fed to the drafter level by level
with an ancestor mask; after verification its caches are compacted to the accepted path (cached
K/V of a node depends only on its ancestors, so the kept entries equal a fresh computation) and
only accepted nodes that were never fed are run. EAGLE re-feeds accepted tokens with the target's
true features, as EAGLE does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.decoding.tree import DraftSpec, DraftTree, TreeGrowth, grow_tree
from vllm_moa.target import TargetOutput


class DraftSession(Protocol):
    """A sequence's drafting state. `start` takes the prompt and the target's outputs over it; a
    session whose `starts_from_suffix` is True (optional attribute, default False) also accepts
    outputs over only the prompt's last m tokens: its model then reads those m tokens alone, at
    positions of its own (what it computes is relative: a shorter context, nothing shifted), and
    lookup still reads the whole prompt."""

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

    # -- drafting many sequences at once (propose_all / accept_all) ---------------------------
    def batch_key(self) -> object | None:
        """Sessions with equal non-None keys can draft in one forward per level (`_open_batch`,
        `_step_batch`, `_close_batch`) and accept in one call (`accept_batch`); None: alone."""
        return None

    @classmethod
    def propose_batch(cls, sessions: Sequence[ModelSession], pendings: Sequence[int], spec: DraftSpec,
                      sampling: SamplingParams | None, generator: torch.Generator | None) -> list[DraftTree]:
        """Every session's tree, grown level by level: one `_step_batch` per level for all of them
        (a session whose tree is grown sits a level out: None in `levels`)."""
        for session in sessions:
            session._begin()
        batch = cls._open_batch(sessions)
        growths = [TreeGrowth(p, spec, sampling, generator, s.device) for s, p in zip(sessions, pendings)]
        while any(levels := [growth.next_level() for growth in growths]):
            for growth, level, logits in zip(growths, levels, cls._step_batch(batch, sessions, levels)):
                if level is not None:
                    growth.advance(logits)
        cls._close_batch(batch, sessions)
        return [growth.result() for growth in growths]

    @classmethod
    def _open_batch(cls, sessions: Sequence[ModelSession]) -> object:
        raise NotImplementedError

    @classmethod
    def _step_batch(cls, batch: object, sessions: Sequence[ModelSession], levels: list) -> list[Tensor | None]:
        raise NotImplementedError

    @classmethod
    def _close_batch(cls, batch: object, sessions: Sequence[ModelSession]) -> None:
        raise NotImplementedError

    @classmethod
    def accept_batch(cls, sessions: Sequence[ModelSession], trees: Sequence[DraftTree], paths: Sequence[list[int]],
                     verified: Sequence[TargetOutput]) -> None:
        raise NotImplementedError

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


def _batch_of(sessions: Sequence[object]) -> type | None:
    """The session class that drafts all of `sessions` together (a class with `batch_key`,
    `propose_batch` and `accept_batch`: ModelSession's subclasses, retrieval.HybridSession), or
    None (one at a time)."""
    first = sessions[0] if len(sessions) > 1 else None
    if not hasattr(first, "batch_key") or any(type(s) is not type(first) for s in sessions):
        return None
    key = first.batch_key()
    return type(first) if key is not None and all(s.batch_key() == key for s in sessions) else None


def drafts_together(sessions: Sequence[object]) -> bool:
    """Whether propose_all / accept_all run these sessions together (one batch) rather than one by one."""
    return _batch_of(sessions) is not None


def propose_all(sessions: Sequence[DraftSession], pendings: Sequence[int], spec: DraftSpec,
                sampling: SamplingParams | None = None, generator: torch.Generator | None = None,
                together: bool = True) -> list[DraftTree]:
    """This round's trees of a batch of sequences: together where their kind drafts in batches
    (and `together`), else session by session (the same trees, up to float rounding in the
    drafter; sampled chains draw in another order)."""
    batch = _batch_of(sessions) if together else None
    if batch is not None:
        return batch.propose_batch(sessions, pendings, spec, sampling, generator)
    return [s.propose(p, spec, sampling, generator) for s, p in zip(sessions, pendings)]


def accept_all(sessions: Sequence[DraftSession], trees: Sequence[DraftTree], paths: Sequence[list[int]],
               verified: Sequence[TargetOutput], together: bool = True) -> None:
    """accept() for a batch of sequences (together where their kind accepts in batches, and `together`)."""
    batch = _batch_of(sessions) if together else None
    if batch is not None:
        batch.accept_batch(sessions, trees, paths, verified)
        return
    for session, tree, path, out in zip(sessions, trees, paths, verified):
        session.accept(tree, path, out)
