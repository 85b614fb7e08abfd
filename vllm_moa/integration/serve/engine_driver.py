"""One thread that owns vLLM's LLMEngine for the client-server backend (vllm_backend.py).

Callers hand it work through a queue and wait on their `_Waiter`: a one-shot request (a
verification round as a new request, a plain generation), or a chunk of a session's resumable
request (vLLM's streaming input, `EngineCoreRequest.resumable`: the request stays in the engine
between chunks with its KV blocks; session_scheduler.py rolls it back to the verified tokens).
The thread adds them, steps the engine while any is in flight (an idle resumable request gives
no output, and the multiprocess client's step() would wait for one), and hands outputs to the
waiters; verification requests get their worker capture (verify_service.py) when they end. If
the engine dies, every call in flight and after gets a 503 and `problem()` says why.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from typing import Any

from vllm_moa.serving.backend import BackendError

ROUND_TIMEOUT_S = 600.0  # a round (or a generation's next token) that takes longer: 503


class EngineStopped(BackendError):
    status = 503


class _SessionGone(RuntimeError):
    """A chunk for a resumable request the engine no longer holds (or a first one for one it does)."""


class _Waiter:
    """One request (or chunk) in flight: the driver puts ("tokens", ids, finished), ("capture",
    dict) or ("error", message, status) on its queue. `key` names its capture; `external` is its
    vLLM request id (the session's for a chunk of a resumable request)."""

    def __init__(self, verify: bool, external: str | None = None, first: bool = False) -> None:
        self.key = uuid.uuid4().hex
        self.verify = verify
        self.external = external or self.key
        self.chunk = external is not None
        self.first = first  # a chunk that starts its resumable request
        self.request_ended = False  # set when a chunk's resumable request ended with it
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def get(self, driver: EngineDriver) -> tuple:
        """The next item; EngineStopped as soon as the engine is found dead (checked each second)."""
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while True:
            try:
                item = self.queue.get(timeout=1.0)
                break
            except queue.Empty:
                problem = driver.problem()
                if problem is not None:
                    raise EngineStopped(f"the vLLM engine stopped: {problem}") from None
                if time.monotonic() > deadline:
                    raise EngineStopped(f"the vLLM engine gave no answer in {ROUND_TIMEOUT_S:.0f} s") from None
        if item[0] == "error":
            raise (EngineStopped if item[2] == 503 else BackendError)(item[1])
        return item


class EngineDriver:
    """vLLM's LLMEngine, owned by one thread."""

    def __init__(self, engine_args: Any) -> None:
        from vllm.v1.engine.llm_engine import LLMEngine

        self.engine = LLMEngine.from_engine_args(engine_args)
        try:
            installed = self.engine.collective_rpc("moa_verify_install")
            if not installed or not all(isinstance(answer, dict) for answer in installed):
                raise RuntimeError("the vLLM workers did not install the verification hook")
            # None, or why a live session's tree cannot be verified in one chunk (session_trees.py)
            self.tree_chunks_unavailable: str | None = installed[0]["tree_chunks"]
        except BaseException:
            self.engine.engine_core.shutdown()  # no engine process outlives a failed start
            raise
        self.error: str | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: dict[str, _Waiter] = {}  # vLLM's external request id -> the waiter in flight
        self._internal: dict[str, str] = {}  # a resumable request's external id -> vLLM's internal id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-moa-engine", daemon=True)
        self._thread.start()

    def submit(self, waiter: _Waiter, prompt: list[int], params: Any) -> _Waiter:
        """A new request, or (a chunk waiter) the next chunk of its session's resumable request:
        the first chunk starts it, the later ones append `prompt` to it."""
        if self.problem() is not None:
            raise EngineStopped(f"the vLLM engine stopped: {self.error}")
        self._inbox.put(("add", waiter, prompt, params))
        return waiter

    def problem(self) -> str | None:
        """None while the engine runs; else what stopped it (also noticed while idle: vLLM's
        client knows when its engine-core process has died)."""
        if self.error is None:
            ensure_alive = getattr(self.engine.engine_core, "ensure_alive", None)  # multiprocess clients
            if ensure_alive is not None:
                try:
                    ensure_alive()
                except Exception as err:  # EngineDeadError
                    self.error = f"{type(err).__name__}: {err}"
        return self.error

    def abort(self, waiter: _Waiter) -> None:
        """Stop the waiter's request (for a chunk: its whole resumable request)."""
        self._inbox.put(("abort", waiter.external))

    def end(self, external: str) -> None:
        """End a session's resumable request (idle or not), freeing its seat and KV blocks."""
        self._inbox.put(("abort", external))

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=30)
        self.error = self.error or "the backend was shut down"
        self._fail_all()
        self.engine.engine_core.shutdown()

    def _fail_all(self) -> None:
        """Answer every request in flight or queued with a 503 (the engine is gone or stopping)."""
        for waiter in list(self._waiting.values()):
            waiter.queue.put(("error", f"the vLLM engine stopped: {self.error}", 503))
        self._waiting.clear()
        while not self._inbox.empty():
            item = self._inbox.get()
            if item[0] == "add":
                item[1].queue.put(("error", f"the vLLM engine stopped: {self.error}", 503))

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self._waiting)
                if self._waiting:
                    self._step()
        except BaseException as err:  # the engine is gone: fail everything, now and later
            self.error = self.error or f"{type(err).__name__}: {err}"
            self._fail_all()

    def _drain(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if item[0] == "add":
                _, waiter, prompt, params = item
                try:
                    self._add(waiter, prompt, params)
                except _SessionGone as err:
                    waiter.queue.put(("error", str(err), 503))
                    continue
                except Exception as err:
                    if self.problem() is None:  # vLLM refused this request (VLLMValidationError, ...)
                        waiter.queue.put(("error", f"vLLM refused the request: {err}", 400))
                        continue
                    waiter.queue.put(("error", f"the vLLM engine stopped: {self.error}", 503))
                    raise
                self._waiting[waiter.external] = waiter
            elif item[0] == "abort":
                external = item[1]
                waiter, resumable = self._waiting.pop(external, None), self._internal.pop(external, None)
                if waiter is not None or resumable is not None:
                    self.engine.abort_request([external])
                if waiter is not None:  # whoever still waits on it learns at once
                    waiter.queue.put(("error", "the vLLM request was ended while in flight", 503))

    def _add(self, waiter: _Waiter, prompt: list[int], params: Any) -> None:
        from vllm.inputs import TokensPrompt

        if not waiter.chunk:
            self.engine.add_request(waiter.key, TokensPrompt(prompt_token_ids=prompt), params)
            return
        # a resumable request: LLMEngine.add_request would give every chunk a new internal id, so
        # the chunk goes the way AsyncLLM's streaming input sends it (same internal id each time)
        processor = self.engine.input_processor
        request = processor.process_inputs(waiter.external, TokensPrompt(prompt_token_ids=prompt), params,
                                           supported_tasks=self.engine.get_supported_tasks(), resumable=True)
        internal = self._internal.get(waiter.external)
        if (internal is None) != waiter.first:
            raise _SessionGone(f"the session's vLLM request {'is gone' if internal is None else 'already runs'}")
        if internal is None:
            processor.assign_request_id(request)
        else:
            request.request_id, request.external_req_id = internal, waiter.external
        self.engine.output_processor.add_request(request, None, None, 0)
        self.engine.engine_core.add_request(request)
        self._internal[waiter.external] = request.request_id

    def _step(self) -> None:
        ended = []
        for out in self.engine.step():
            waiter = self._waiting.get(out.request_id)
            if waiter is None:
                continue
            # a chunk of a resumable request ends with a finish reason, the request itself does not
            done = out.finished or (waiter.chunk and out.outputs[0].finish_reason is not None)
            if waiter.verify:
                if done:
                    ended.append(self._waiting.pop(out.request_id))
                    if out.finished and waiter.chunk:  # the resumable request itself ended (an error)
                        self._internal.pop(waiter.external, None)
                        waiter.request_ended = True
                continue
            waiter.queue.put(("tokens", list(out.outputs[0].token_ids), out.finished))
            if out.finished:
                del self._waiting[out.request_id]
        if ended:
            captures = self.engine.collective_rpc("moa_verify_take", args=([w.key for w in ended],))[0]
            for waiter in ended:
                capture = captures.get(waiter.key)
                if capture is None or "error" in capture:
                    why = capture["error"] if capture else "it kept no capture of this round"
                    waiter.queue.put(("error", f"the vLLM worker could not read this round: {why}", 503))
                else:
                    waiter.queue.put(("capture", capture))
