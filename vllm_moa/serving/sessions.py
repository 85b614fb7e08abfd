"""What the server holds, and for whom: its sessions (unguessable ids bound to the client that
opened them, expiring after an idle TTL and a maximum age, enforced on access and by a reaper)
and its running /v1/generate calls, with their limits:

* counts: sessions in all and per client; generations in flight in all and per client;
* memory: a token budget over everything held at once. Each session counts the tokens whose K/V
  the target keeps for it (its length; during a verify, its length at the draft's root plus the
  draft); each generation counts its prompt plus its max_tokens from the start.

A slot is taken before any work runs (before the prefill, before the first generated token), so a
burst cannot overshoot. Server-wide limits answer 503 (Retry-After: the server is busy now); a
client's own limits answer 429.

`clock` is injectable so that tests can move time instead of sleeping.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_moa.serving.backend import BackendError, BackendSession
from vllm_moa.serving.protocol import ServerLimits


class SessionNotFound(BackendError):
    status = 404


class TooManySessions(BackendError):
    """A client's own limit (its sessions, its generations in flight)."""

    status = 429


class ServerBusy(BackendError):
    """A server-wide limit (sessions, generations in flight, the token budget): retry later."""

    status = 503
    headers = {"Retry-After": "1"}


@dataclass
class _Entry:
    session: BackendSession
    client: str
    created: float
    last_used: float
    tokens: int  # K/V the target holds for it (budget)
    in_flight: int = 0  # requests being served: never idle meanwhile (a slow target's verify > the TTL)


@dataclass
class _Hold:
    client: str
    kind: str  # "session" (being opened) | "generation" (running)
    tokens: int


class Slot:
    """A reservation (a session being opened, a running generation); `release()` is idempotent."""

    def __init__(self, store: SessionStore, key: int) -> None:
        self.store, self.key = store, key

    def release(self) -> None:
        self.store._release(self.key)

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class SessionStore:
    def __init__(self, limits: ServerLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self._entries: dict[str, _Entry] = {}
        self._holds: dict[int, _Hold] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def count(self, client: str, kind: str = "session") -> int:
        with self._lock:
            return self._count(client, kind)

    def generations(self) -> int:
        with self._lock:
            return sum(1 for h in self._holds.values() if h.kind == "generation")

    def tokens_held(self) -> int:
        with self._lock:
            return self._tokens()

    def _count(self, client: str | None, kind: str) -> int:
        held = sum(1 for h in self._holds.values() if h.kind == kind and client in (None, h.client))
        if kind == "session":
            held += sum(1 for e in self._entries.values() if client in (None, e.client))
        return held

    def _tokens(self) -> int:
        return sum(e.tokens for e in self._entries.values()) + sum(h.tokens for h in self._holds.values())

    def _check_budget(self, more: int) -> None:
        held, budget = self._tokens(), self.limits.max_total_tokens
        if held + more > budget:
            raise ServerBusy(f"the server holds K/V for {held} tokens and this needs {more} more: over its budget of "
                             f"{budget} tokens (max_total_tokens); retry later")

    # -- reservations ------------------------------------------------------------------------------
    def reserve(self, client: str, tokens: int) -> Slot:
        """A session slot for `client` while its session (of `tokens` tokens) is being built:
        `with store.reserve(client, n) as slot: ... store.add(slot, session)`."""
        self.reap()
        limits = self.limits
        return self._admit(client, "session", tokens, limits.max_sessions_per_client, limits.max_sessions,
                           f"this client has {limits.max_sessions_per_client} open sessions (the per-client "
                           "limit); close one first",
                           f"the server has {limits.max_sessions} open sessions (its limit); retry later")

    def admit_generation(self, client: str, tokens: int) -> Slot:
        """A slot for a /v1/generate call that may hold `tokens` tokens; release it when it ends."""
        limits = self.limits
        return self._admit(client, "generation", tokens, limits.max_generations_per_client, limits.max_generations,
                           f"this client has {limits.max_generations_per_client} generations running (the "
                           "per-client limit); wait for one to finish",
                           f"the server is running {limits.max_generations} generations (its limit); retry later")

    def _admit(self, client: str, kind: str, tokens: int, per_client: int, overall: int,
               per_client_message: str, overall_message: str) -> Slot:
        """Hold a slot of `kind` if the client's count, the server's count and the token budget allow."""
        with self._lock:
            if self._count(client, kind) >= per_client:
                raise TooManySessions(per_client_message)
            if self._count(None, kind) >= overall:
                raise ServerBusy(overall_message)
            self._check_budget(tokens)
            return self._hold(client, kind, tokens)

    def _hold(self, client: str, kind: str, tokens: int) -> Slot:
        key = next(self._keys)
        self._holds[key] = _Hold(client, kind, tokens)
        return Slot(self, key)

    def _release(self, key: int) -> None:
        with self._lock:
            self._holds.pop(key, None)

    # -- sessions --------------------------------------------------------------------------------
    def add(self, slot: Slot, session: BackendSession) -> str:
        """Register the session built under `slot` (its reservation becomes the session); returns its id."""
        now = self.clock()
        session_id = secrets.token_urlsafe(18)
        with self._lock:
            hold = self._holds.pop(slot.key)
            self._entries[session_id] = _Entry(session, hold.client, now, now, hold.tokens)
        return session_id

    def get(self, client: str, session_id: str) -> BackendSession:
        now = self.clock()
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None or entry.client != client:
                raise SessionNotFound(f"no session {session_id!r} for this client (closed, expired or never opened)")
            if self._expired(entry, now):
                del self._entries[session_id]
                raise SessionNotFound(f"session {session_id!r} expired")
            entry.last_used = now
            entry.in_flight += 1  # until settle()
            return entry.session

    def charge(self, session_id: str, tokens: int) -> None:
        """The session is about to hold up to `tokens` tokens (a verify: its draft's root position
        plus the draft); refused when that would exceed the server's budget."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None or tokens <= entry.tokens:
                return
            self._check_budget(tokens - entry.tokens)
            entry.tokens = tokens

    def settle(self, session_id: str, tokens: int) -> None:
        """The request that get() began is over; the session now holds `tokens` tokens and is idle
        from now."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is not None:
                entry.tokens = tokens
                entry.in_flight = max(0, entry.in_flight - 1)
                entry.last_used = self.clock()

    def remove(self, client: str, session_id: str) -> BackendSession:
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None or entry.client != client:
                raise SessionNotFound(f"no session {session_id!r} for this client (closed, expired or never opened)")
            del self._entries[session_id]
            return entry.session

    def reap(self) -> list[BackendSession]:
        """Drop expired sessions; returns them (the caller frees their caches)."""
        now = self.clock()
        with self._lock:
            expired = [sid for sid, e in self._entries.items() if self._expired(e, now)]
            return [self._entries.pop(sid).session for sid in expired]

    def _expired(self, entry: _Entry, now: float) -> bool:
        idle = entry.in_flight == 0 and now - entry.last_used > self.limits.session_idle_ttl_s
        return idle or now - entry.created > self.limits.session_max_age_s
