"""Pipelined rounds on the server: a verify request sent before the verdict of the client's
earlier round (`VerifyRequest.after`) waits for that round here, on the event loop (a waiting
request holds no worker thread), then runs right after it or is refused (backend.Superseded, 409).

Bounded: at most `max_rounds_in_flight` requests of one session wait at once (more: 429), and
each waits at most `round_wait_s` (then 409: its earlier round never came).
"""

from __future__ import annotations

import asyncio
from collections import Counter

from vllm_moa.serving.backend import BackendSession, Superseded
from vllm_moa.serving.protocol import ServerLimits, VerifyRequest
from vllm_moa.serving.sessions import TooManySessions


class RoundOrder:
    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self._waiting: Counter[int] = Counter()  # id(session) -> requests waiting
        self._changed: asyncio.Condition | None = None  # created on the server's event loop

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def wait_turn(self, session: BackendSession, request: VerifyRequest) -> None:
        """Return once the round `request` follows has been answered (or the session closed)."""
        if request.after is None or session.last_round >= request.after:
            return
        key = id(session)
        if self._waiting[key] >= self.limits.max_rounds_in_flight:
            raise TooManySessions(f"this session has {self._waiting[key]} pipelined rounds waiting for earlier ones "
                                  f"(the limit, max_rounds_in_flight); wait for a verdict first")
        self._waiting[key] += 1
        changed = self._condition()
        try:
            async with changed:
                await asyncio.wait_for(
                    changed.wait_for(lambda: session.last_round >= request.after or session.closed),
                    self.limits.round_wait_s)
        except asyncio.TimeoutError:
            raise Superseded(f"round {request.round} waited {self.limits.round_wait_s:g}s for round {request.after}, "
                             "which never came: not verified") from None
        finally:
            self._waiting[key] -= 1
            if not self._waiting[key]:
                del self._waiting[key]

    async def answered(self) -> None:
        """A round was answered: wake the requests waiting for it."""
        if self._changed is None or not self._waiting:
            return  # nobody waits
        async with self._changed:
            self._changed.notify_all()
