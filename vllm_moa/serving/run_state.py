"""One generation of the remote-drafting client (client.py): its state, and how a new state is
applied (the stop rules) and told as stream events."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.decoding.speed_control import FasterShape
from vllm_moa.serving.adaptive import DraftController
from vllm_moa.serving.local import LocalSession
from vllm_moa.serving.pipeline import Round
from vllm_moa.serving.stream import ClientResult, StreamEvent


@dataclass
class RunState:
    prompt: list[int]
    max_tokens: int
    eos: int | None
    sampling: SamplingParams | None
    generator: torch.Generator | None
    seed: int | None
    result: ClientResult
    local: LocalSession | None = None
    controller: DraftController | None = None  # the depth controller of this round's shape
    controllers: dict[str, DraftController] = field(default_factory=dict)  # shape -> its controller
    shapes: FasterShape | None = None  # trees with chain_if_faster: the tree or the chain, by speed
    shape: str = "chain"  # this round's shape (CHAIN or TREE)
    out: list[int] = field(default_factory=list)
    nv: int = 0  # out[:nv] verified; out[nv-1] is the pending token (the target's, not yet run)
    seq: int = 0  # tokens the target has run = len(prompt) + nv - 1
    session_id: str | None = None
    offline: bool = False
    offline_since: float = 0.0
    failures: int = 0
    next_try: float = 0.0
    stale: int = 0  # consecutive 404/409 answers
    done: bool = False
    first_round: bool = False  # the session was (re)opened and has not verified a round yet
    inflight: deque[Round] = field(default_factory=deque)  # rounds sent, oldest first (pipeline.py)
    rounds: int = 0  # rounds sent (their numbers, increasing over the run's sessions)
    pipeline: int = 1  # rounds in flight at most: the client's, capped by what the server holds waiting
    last_verdict: float = 0.0  # perf_counter() of the latest verdict


def advance(run: RunState, old_out: list[int], old_nv: int, out: list[int], nv: int) -> Iterator[StreamEvent]:
    """Apply the new state (after the stop rules) and emit the events that lead there."""
    new = out[old_nv:nv]
    if run.eos is not None and run.eos in new:
        cut = old_nv + new.index(run.eos) + 1
        out, nv = out[:cut], cut
        run.done, run.result.finish_reason = True, "eos"
    if nv >= run.max_tokens:
        out, nv = out[: run.max_tokens], run.max_tokens
        run.done, run.result.finish_reason = True, "length"
    common = 0
    limit = min(len(old_out), len(out))
    while common < limit and old_out[common] == out[common]:
        common += 1
    run.out, run.nv = list(out), nv
    if common < len(old_out):
        yield StreamEvent("rollback", common)
    if nv > old_nv:
        yield StreamEvent("verified", old_nv, out[old_nv:nv])
