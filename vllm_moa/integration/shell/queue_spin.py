"""How long vLLM's shared-memory queues busy-poll after a read: `VLLM_MOA_ENGINE_SPIN_MS`.

vLLM's engine core and workers pass each step's input and output through shared-memory ring
buffers (vllm/distributed/device_communicators/shm_broadcast.py). A reader that has just read
keeps polling its buffer, yielding the CPU in between, for `SpinCondition.busy_loop_s` (1 s)
before it sleeps on a socket until the writer notifies it. Under steady load that saves a
wake-up per step; an engine that waits on the network between calls (the client-server
backend: a round trip per round) pays up to a second of CPU per reader after every step, on
the cores its clients and its own next step need (docs/client-server.md).

`SpinConditionPatch` gives readers the env's spin instead, where one is set (inert otherwise:
vLLM's own in `vllm serve`); `engine_spin` sets it for the engine processes started inside it,
unless the user set it. The patch is applied in every vLLM process (patches.apply_all), since
the readers live in the engine core and the workers, which the env reaches at their start.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

from vllm_moa import envs
from vllm_moa.integration.shell.patching import VllmPatch

SPIN_ENV = "VLLM_MOA_ENGINE_SPIN_MS"


class SpinConditionPatch(VllmPatch):
    """SpinCondition.__init__: a reader's busy-poll after a read is VLLM_MOA_ENGINE_SPIN_MS when set."""

    symbol = "shm_spin_condition_init"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def __init__(self, is_reader, context, notify_address, busy_loop_s=1):
            spin_ms = envs.VLLM_MOA_ENGINE_SPIN_MS
            if is_reader and spin_ms is not None:
                busy_loop_s = spin_ms / 1000
            original(self, is_reader, context, notify_address, busy_loop_s)

        setattr(owner, attr, __init__)


@contextlib.contextmanager
def engine_spin(default_ms: float) -> Iterator[float]:
    """VLLM_MOA_ENGINE_SPIN_MS = `default_ms` for the engine processes started inside (the
    user's value where one is set, checked first: a bad one raises ValueError naming it); yields
    the value in force."""
    user = envs.VLLM_MOA_ENGINE_SPIN_MS
    if user is not None:
        yield user
        return
    os.environ[SPIN_ENV] = f"{default_ms:g}"
    try:
        yield default_ms
    finally:
        os.environ.pop(SPIN_ENV, None)
