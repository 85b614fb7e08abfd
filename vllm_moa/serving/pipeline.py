"""Pipelined rounds on the client: verify requests sent before the verdict of the round ahead.

A round's chain is drafted past the drafts still in flight: its root is the drafter's guess for
the target's next token after the round ahead, at the position that round reaches if all its
drafts are accepted. The server verifies it right after that round, only if that round left the
session exactly there with that next token (protocol.VerifyRequest.after), and refuses it (409,
nothing run) otherwise; the client knows which from the earlier verdict and discards it with the
rounds behind it. Greedy and sampled output stay as without pipelining: a pipelined round is
verified from the same state, with the same checks, as the round the client would have sent next.

    RoundSender(transport, workers)   rounds sent from worker threads (several in flight)
    Round                             one round in flight
    lookup_ahead(...)                 a round's tokens by lookup past the chains in flight (free)
    pipeline_pays(...)                whether one more round in flight pays (measured rates)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from vllm_moa.decoding.retrieval import Retrieval, lookup_found
from vllm_moa.decoding.tree import DraftSpec, DraftTree
from vllm_moa.serving.protocol import VerifyResponse
from vllm_moa.serving.transport import Transport


@dataclass
class Round:
    id: int  # the client's number for it (VerifyRequest.round)
    seq: int  # its root's position
    tree: DraftTree
    future: Future  # -> VerifyResponse
    sent: float  # perf_counter() when it went out
    draft_s: float | None  # drafting time (None: a resync of unverified tokens)
    after: int | None = None  # pipelined: the round it follows
    chained: bool = False  # its local state is rebuilt from the verified tokens when it is accepted

    @property
    def root(self) -> int:
        return int(self.tree.tokens[0])

    @property
    def is_chain(self) -> bool:
        return self.tree.size > 1 and self.tree.is_chain


def drafted_chain(rounds: Sequence[Round]) -> list[int]:
    """The tokens of chains in flight, in order: [pending, drafts..., guessed root, drafts...]."""
    return [token for r in rounds for token in r.tree.tokens.tolist()]


def lookup_ahead(retrieval: Retrieval | None, verified: Sequence[int], chain: list[int], n: int) -> list[int]:
    """The n tokens after `chain` (the chains in flight, after the `verified` text) by lookup, when it
    finds a continuation as long as it would draft alone (at least 2: a root and a draft); else []."""
    if retrieval is None:
        return []
    found = lookup_found(retrieval, list(verified) + chain[:-1], chain[-1], DraftSpec.chain(n))
    return found[0][:n] if found and len(found[0]) >= max(2, min(n, retrieval.alone_at or n)) else []


def continues(head: Round, response: VerifyResponse, following: Round) -> bool:
    """`following` stays valid after `head`'s verdict: every draft accepted, and the target's next
    token is the root `following` was drafted from."""
    return len(response.path) == head.tree.size and response.next_token == following.root


class RoundSender:
    """Verify requests sent from worker threads, so that several rounds can be in flight."""

    def __init__(self, transport: Transport, workers: int) -> None:
        self.transport = transport
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moa-verify")

    def send(self, session_id: str, number: int, seq: int, tree: DraftTree, draft_s: float | None,
             after: Round | None = None) -> Round:
        """Round `number` of the session: `tree` at position `seq`, pipelined behind `after` if given
        (its chain is then accepted from the verified state)."""
        after_id = None if after is None else after.id
        body = {"seq": seq, "tree": {"tokens": tree.tokens.tolist(), "parents": list(tree.parents)}, "round": number,
                "after": after_id}
        future = self.pool.submit(self.transport.call, "POST", f"/v1/sessions/{session_id}/verify", body,
                                  VerifyResponse, (404, 409))
        return Round(number, seq, tree, future, time.perf_counter(), draft_s, after=after_id, chained=after is not None)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


MIN_CHANCE = 0.1  # below this a round in flight is drafted mostly to be thrown away


def pipeline_pays(rate: float, levels: int, saved_s: float, draft_s: float) -> bool:
    """One more round in flight pays when the chance that it is verified (every round ahead of it
    accepted whole and its guessed root right: rate ** levels, `rate` the measured per-level
    acceptance) times what it saves (a round's network time and the server's verification)
    exceeds its drafting time, spent whether or not it is used (in full: where the client shares
    cores with the server, as in this repository's benchmarks, drafting during the wait is not
    free)."""
    chance = rate ** levels
    return chance >= MIN_CHANCE and chance * saved_s > draft_s
