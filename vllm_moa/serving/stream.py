"""What a remote-drafting client emits and returns: stream events (verified / unverified /
rollback / done), the transcript a consumer rebuilds from them, the final result, and the errors
a caller can catch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


class ServerUnavailable(ConnectionError):
    """The server could not be reached for long enough to start (or finish) a generation."""


class RequestRefused(ValueError):
    """The server refused a request with a 4xx (bad input, auth, limits, mismatched drafter)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"server refused the request ({status}): {message}")
        self.status, self.message = status, message


class ProtocolError(RuntimeError):
    """The server's answer is inconsistent with the request (a server bug, not a network fault)."""


@dataclass
class StreamEvent:
    """kind = verified:   tokens[start : start+len] are the target's (confirming unverified ones or
                          appending); unverified: drafted alone, appended at start; rollback: the
                          tokens from start on are gone; done: `result` is final."""

    kind: Literal["verified", "unverified", "rollback", "done"]
    start: int
    tokens: list[int] = field(default_factory=list)
    result: ClientResult | None = None


class Transcript:
    """The output as a consumer of StreamEvents sees it."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.num_verified = 0

    def apply(self, event: StreamEvent) -> None:
        if event.kind == "rollback":
            if event.start < self.num_verified:
                raise ProtocolError("rollback into verified tokens")
            del self.tokens[event.start:]
        elif event.kind in ("verified", "unverified"):
            if event.start > len(self.tokens) or (event.kind == "unverified" and event.start != len(self.tokens)):
                raise ProtocolError(f"{event.kind} tokens at {event.start} leave a gap after {len(self.tokens)}")
            end = event.start + len(event.tokens)
            if event.kind == "verified":
                if event.start != self.num_verified:
                    raise ProtocolError(f"verified tokens at {event.start}, expected {self.num_verified}")
                self.num_verified = end
            self.tokens[event.start:end] = event.tokens


@dataclass
class ClientResult:
    token_ids: list[int]
    num_verified: int  # token_ids[:num_verified] were verified by the target
    finish_reason: str = "length"  # length | eos | disconnected
    text: str | None = None
    seconds: float = 0.0
    ttft: float = 0.0
    calls: int = 0  # HTTP requests made (including failed ones)
    verify_calls: int = 0  # successful verifications
    bytes_sent: int = 0  # HTTP request bytes (headers + body), as sent by this client
    bytes_received: int = 0  # HTTP response bytes (headers + body)
    accepted_per_verify: list[int] = field(default_factory=list)  # path length (root included) per fresh draft
    drafted_per_verify: list[int] = field(default_factory=list)  # draft depth per fresh draft
    draft_seconds: float = 0.0
    server_seconds: float = 0.0  # the server's own time for this generation's calls, as it reports it
    failures: int = 0  # transient errors
    disconnects: int = 0  # online -> offline transitions
    reopens: int = 0  # sessions reopened (404 / 409)
    offline_tokens: int = 0  # tokens drafted while offline
    offline_confirmed: int = 0  # of those, confirmed by the target
    rollbacks: int = 0
    rolled_back_tokens: int = 0
    lookup_rounds: dict[str, int] = field(default_factory=lambda: {"model": 0, "merged": 0, "retrieval": 0})
    shape_rounds: dict[str, int] = field(default_factory=dict)  # fresh rounds by draft shape ("tree", "chain")
    pipelined_rounds: int = 0  # rounds sent before the verdict of the round ahead (pipeline.py)
    pipelined_verified: int = 0  # of those, verified (the others were discarded: the round ahead ended short)

    @property
    def verified_mask(self) -> list[bool]:
        return [i < self.num_verified for i in range(len(self.token_ids))]

    @property
    def acceptance_length(self) -> float:
        return sum(self.accepted_per_verify) / max(1, len(self.accepted_per_verify))
