"""The server's session table: unguessable ids bound to the client that opened them, limits on
sessions in all and per client (a slot is reserved before the prefill runs, so a burst of opens
cannot overshoot), and expiry (idle TTL and maximum age), enforced on access and by a reaper.

`clock` is injectable so that tests can move time instead of sleeping.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from vllm_moa.serving.backend import BackendError, BackendSession
from vllm_moa.serving.protocol import ServerLimits


class SessionNotFound(BackendError):
    status = 404


class TooManySessions(BackendError):
    status = 429


@dataclass
class _Entry:
    session: BackendSession
    client: str
    created: float
    last_used: float


class SessionStore:
    def __init__(self, limits: ServerLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self._entries: dict[str, _Entry] = {}
        self._reserved: dict[str, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def count(self, client: str) -> int:
        with self._lock:
            return self._count(client)

    def _count(self, client: str) -> int:
        return sum(1 for e in self._entries.values() if e.client == client) + self._reserved.get(client, 0)

    @contextmanager
    def reserve(self, client: str) -> Iterator[None]:
        """Hold a session slot for `client` while its session is being built."""
        self.reap()
        with self._lock:
            if len(self._entries) + sum(self._reserved.values()) >= self.limits.max_sessions:
                raise TooManySessions(f"the server has {self.limits.max_sessions} open sessions (its limit); "
                                      "close one or retry later")
            if self._count(client) >= self.limits.max_sessions_per_client:
                raise TooManySessions(f"this client has {self.limits.max_sessions_per_client} open sessions "
                                      "(the per-client limit); close one first")
            self._reserved[client] = self._reserved.get(client, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._reserved[client] -= 1
                if not self._reserved[client]:
                    del self._reserved[client]

    def add(self, client: str, session: BackendSession) -> str:
        """Register a built session (inside `reserve`); returns its id."""
        now = self.clock()
        session_id = secrets.token_urlsafe(18)
        with self._lock:
            self._entries[session_id] = _Entry(session, client, now, now)
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
            return entry.session

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
        return (now - entry.last_used > self.limits.session_idle_ttl_s
                or now - entry.created > self.limits.session_max_age_s)
