"""Which client-server sessions keep a live vLLM request between rounds, within bounds.

A live session's resumable request (engine_driver.py, session_scheduler.py) holds a seat of the
engine's `max_num_seqs` and its KV blocks while its client drafts. So there are at most
`max_sessions` of them, holding at most `max_tokens` tokens together; to make room for a new one
the least recently used idle ones end (their next round starts a new request: the prefix cache
still holds their full blocks). A session whose round is in flight is never ended under it.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LiveRequest:
    """One session's resumable request: vLLM knows it as `external`; its first `valid` tokens
    are the session's verified tokens with their KV computed (0 before its first chunk)."""

    session: Any
    external: str = field(default_factory=lambda: uuid.uuid4().hex)
    valid: int = 0
    busy: bool = False
    ended: bool = False

    @property
    def started(self) -> bool:
        """Its first chunk ran (a released request holds at least its prompt)."""
        return self.valid > 0


class LiveSessions:
    def __init__(self, end_request: Any, max_sessions: int, max_tokens: int) -> None:
        self._end = end_request  # callable(external): ends the request in the engine
        self.max_sessions, self.max_tokens = max_sessions, max_tokens
        self._lock = threading.Lock()
        self._live: OrderedDict[str, LiveRequest] = OrderedDict()  # least recently used first

    def claim(self, session: Any, tokens: int) -> LiveRequest | None:
        """The session's live request for a round that leaves it `tokens` long (started now if
        there is room, ending idle ones if needed), marked busy; None: no room (every seat busy)."""
        with self._lock:
            live = getattr(session, "live", None)
            if live is not None and not live.ended:
                self._live.move_to_end(live.external)
            else:
                live = LiveRequest(session)
                if not self._make_room(tokens):
                    return None
                self._live[live.external] = live
                session.live = live
            live.busy = True
            return live

    def release(self, live: LiveRequest, valid: int) -> None:
        with self._lock:
            live.valid, live.busy = valid, False

    def end(self, live: LiveRequest | None) -> None:
        """End a live request (a failed round, a closed session): its seat and blocks are freed."""
        if live is None:
            return
        with self._lock:
            self._end_locked(live)

    def forget(self, live: LiveRequest) -> None:
        """The engine ended it already (vLLM finished the request): drop it without telling vLLM."""
        with self._lock:
            live.ended, live.busy = True, False
            self._live.pop(live.external, None)

    def held(self) -> tuple[int, int]:
        """(live requests, tokens they hold)."""
        with self._lock:
            return len(self._live), sum(lr.valid for lr in self._live.values())

    def _make_room(self, tokens: int) -> bool:
        idle = [lr for lr in self._live.values() if not lr.busy]
        count, held = len(self._live), sum(lr.valid for lr in self._live.values())
        while idle and (count >= self.max_sessions or held + tokens > self.max_tokens):
            oldest = idle.pop(0)
            count, held = count - 1, held - oldest.valid
            self._end_locked(oldest)
        return count < self.max_sessions and held + tokens <= self.max_tokens

    def _end_locked(self, live: LiveRequest) -> None:
        if live.ended:
            return
        live.ended = True
        self._live.pop(live.external, None)
        self._end(live.external)  # the engine ignores one it does not hold
