"""Clients that draft elsewhere (issue 65, item 2): record what a drafting client sends and when,
then replay it against a server from many users at once without drafting here.

A greedy client's rounds are a function of the verified prefix: the drafts of round r depend only
on what the target verified before it. So one real client run per prompt, recorded at the HTTP
level (every request body, every answer, the time between an answer and the next request: the
client's drafting), can be sent again by any number of users, each with its own session, waiting
the recorded drafting time between an answer and its next request. The server does exactly what it
did for the real client; the replaying users cost the server's cores only their HTTP calls.

Each replayed answer is compared with the recorded one (accepted tokens and next token): a user
whose answer differs (a near-tie that batching resolved the other way) stops there and is counted
in `diverged`, its tokens up to that point kept.

    recording = record_run(client, prompt, max_tokens)   # a RemoteDraftingClient, greedy
    outcome = replay_users(url, [recording, ...], users=16)
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx
from pydantic import BaseModel

from vllm_moa.decoding.tree import depths_from_parents
from vllm_moa.serving.client import RemoteDraftingClient


@dataclass
class Exchange:
    """One HTTP call the client made: what it sent, what came back, and when."""

    method: str
    path: str
    body: dict | None
    answer: dict | None
    sent: float
    received: float


@dataclass
class Round:
    """One verify of a recorded run: the wait before it (the client's own time since the last
    answer), its body, and the answer the recording got."""

    wait_s: float
    body: dict
    accepted: list[int]
    next_token: int


@dataclass
class Recording:
    """A recorded greedy generation: the open, its rounds, the tokens they delivered."""

    prompt: list[int]
    max_tokens: int
    open_body: dict
    first_token: int
    rounds: list[Round]  # the first one's wait includes starting the drafter on the prompt
    token_ids: list[int]  # the client's output

    @property
    def drafting_s(self) -> float:
        return sum(r.wait_s for r in self.rounds)


class RecordingTransport:
    """The client's Transport, with every successful `call` kept as an Exchange."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.exchanges: list[Exchange] = []

    def call(self, method: str, path: str, body: dict | None, model: type[BaseModel] | None,
             stale: tuple[int, ...] = ()):
        sent = time.perf_counter()
        answer = self.inner.call(method, path, body, model, stale)
        received = time.perf_counter()
        dumped = answer.model_dump() if isinstance(answer, BaseModel) else answer
        self.exchanges.append(Exchange(method, path, body, dumped, sent, received))
        return answer

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def record_run(client: RemoteDraftingClient, prompt: list[int], max_tokens: int) -> Recording:
    """One greedy generation by `client`, recorded, its rounds one after another (no pipelined
    rounds: each replayed round waits for the answer before it). Refuses a run that reopened its
    session or went offline: its requests would not replay on a fresh session."""
    recorder = RecordingTransport(client.transport)
    client.transport = client.sender.transport = recorder  # verify requests go through the sender
    pipeline, client.pipeline = client.pipeline, 1
    try:
        result = client.generate(prompt, max_tokens)
    finally:
        client.transport = client.sender.transport = recorder.inner
        client.pipeline = pipeline
    if result.reopens or result.num_verified != len(result.token_ids):
        raise RuntimeError(f"the recorded run reopened its session ({result.reopens}) or left tokens unverified")
    opens = [e for e in recorder.exchanges if e.method == "POST" and e.path == "/v1/sessions"]
    verifies = [e for e in recorder.exchanges if e.method == "POST" and e.path.endswith("/verify")]
    if len(opens) != 1:
        raise RuntimeError(f"the recorded run opened {len(opens)} sessions, not one")
    opened = opens[0]
    rounds, last = [], opened.received
    for exchange in verifies:
        rounds.append(Round(exchange.sent - last, exchange.body, exchange.answer["accepted"],
                            exchange.answer["next_token"]))
        last = exchange.received
    return Recording(list(prompt), max_tokens, opened.body, opened.answer["first_token"], rounds,
                     list(result.token_ids))


@dataclass
class UserOutcome:
    tokens: int = 0
    deliveries: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens delivered)
    diverged_at: int | None = None  # the round whose answer differed from the recording
    error: str | None = None


def replay_one(http: httpx.Client, recording: Recording, clock=time.perf_counter) -> UserOutcome:
    """Replay `recording` on a fresh session through `http`; see the module docstring."""
    outcome = UserOutcome()
    response = http.post("/v1/sessions", json=recording.open_body)
    if response.status_code != 200:
        outcome.error = f"open: {response.status_code} {response.text[:200]}"
        return outcome
    opened = response.json()
    session = opened["session_id"]
    if opened["first_token"] != recording.first_token:
        outcome.diverged_at = 0
        http.delete(f"/v1/sessions/{session}")
        return outcome
    outcome.deliveries.append((clock(), 1))
    delivered = 1
    try:
        for index, step in enumerate(recording.rounds, start=1):
            if delivered >= recording.max_tokens:
                break
            time.sleep(step.wait_s)
            response = http.post(f"/v1/sessions/{session}/verify", json=step.body)
            if response.status_code != 200:
                outcome.error = f"round {index}: {response.status_code} {response.text[:200]}"
                break
            answer = response.json()
            if answer["accepted"] != step.accepted or answer["next_token"] != step.next_token:
                outcome.diverged_at = index
                break
            count = min(len(step.accepted) + 1, recording.max_tokens - delivered)
            delivered += count
            outcome.deliveries.append((clock(), count))
    finally:
        http.delete(f"/v1/sessions/{session}")
    outcome.tokens = delivered
    return outcome


def gaps_of(deliveries: list[tuple[float, int]]) -> list[float]:
    """Time between tokens as a user sees them: a delivery of k tokens t s after the previous one
    counts k gaps of t/k (the first delivery, time to first token, left out)."""
    gaps = []
    for (before, _), (now, count) in zip(deliveries, deliveries[1:]):
        gaps.extend([(now - before) / count] * count)
    return gaps


def replay_users(url: str, recordings: list[Recording], users: int, timeout: float = 300.0) -> dict:
    """`users` replaying users at once, user i replaying recordings[i % len]; all start together.
    Returns tokens, wall_s, gaps (seconds), diverged, errors and each user's deliveries."""
    outcomes: list[UserOutcome | None] = [None] * users
    barrier = threading.Barrier(users + 1)

    def user(i: int) -> None:
        with httpx.Client(base_url=url, timeout=timeout) as http:
            barrier.wait()
            try:
                outcomes[i] = replay_one(http, recordings[i % len(recordings)])
            except httpx.HTTPError as err:
                outcomes[i] = UserOutcome(error=f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=user, args=(i,)) for i in range(users)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    gaps = [gap for outcome in outcomes for gap in gaps_of(outcome.deliveries)]
    return {"tokens": sum(o.tokens for o in outcomes), "wall_s": wall, "gaps": gaps,
            "diverged": [{"user": i, "round": o.diverged_at} for i, o in enumerate(outcomes)
                         if o.diverged_at is not None],
            "errors": [f"user {i}: {o.error}" for i, o in enumerate(outcomes) if o.error],
            "deliveries": [o.deliveries for o in outcomes]}


def depth_of(body: dict) -> int:
    """The drafted depth of a verify body's tree (0: the root alone)."""
    return max(depths_from_parents(body["tree"]["parents"]))


def describe(recordings: list[Recording]) -> dict:
    """What the recorded clients did: rounds, tokens per round, drafting time per round, and the
    share of rounds whose draft was accepted to its full depth (only after such a round could a
    next round drafted before its answer, on the assumption that all is accepted, be verified)."""
    rounds = [r for rec in recordings for r in rec.rounds]
    drafted = [r for r in rounds if depth_of(r.body) > 0]
    return {"runs": len(recordings), "rounds": len(rounds),
            "fully_accepted_share": round(sum(len(r.accepted) == depth_of(r.body) for r in drafted) / len(drafted), 3)
            if drafted else None,
            "tokens_per_round": round(statistics.mean(len(r.accepted) + 1 for r in rounds), 3) if rounds else None,
            "drafted_nodes_per_round": round(statistics.mean(len(r.body["tree"]["tokens"]) - 1 for r in rounds), 3)
            if rounds else None,
            "drafting_ms_per_round": round(1e3 * statistics.mean(r.wait_s for r in rounds), 2) if rounds else None}
