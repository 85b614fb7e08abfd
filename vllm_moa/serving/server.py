"""The verification server: a FastAPI app over a `TargetBackend` (protocol.py lists the routes).

Handlers are async: parsing, auth and admission run on the event loop and answer at once; only
target work (prefill, verify, generation, freeing a session) goes to a worker thread, and the
backend serialises target forwards, so many sessions interleave round by round. So /v1/health and
every refusal are answered even while all workers wait for the target; authentication is an ASGI
middleware that answers before the body is read (security.py); /v1/generate calls are admitted (in
all and per client) before they take a worker for long. Memory is bounded by a token budget over
all sessions and generations, and each sequence by `max_session_tokens` and the target's context
window (sessions.py). Every refusal is a 4xx (a 503 when the server as a whole is at a limit)
with {"error": message}; anything unexpected is logged and answered 500 without killing the
server.

    create_app(backend, limits, tokens)   the ASGI app (GET /metrics: Prometheus, metrics.py)
    serve(...)                            run it with uvicorn (the `vllm-moa serve` command)
    ServerThread(app)                     run it on 127.0.0.1 in a background thread (tests,
                                          benchmarks, examples): `with ServerThread(app) as url: ...`
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

from fastapi import Depends, FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException  # routing's 404/405 too, not only FastAPI's own

from vllm_moa.serving.backend import BackendError, TargetBackend
from vllm_moa.serving.metrics import MetricsMiddleware, ServerMetrics
from vllm_moa.serving.protocol import (
    PROTOCOL,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    OpenRequest,
    OpenResponse,
    ServerLimits,
    VerifyRequest,
    VerifyResponse,
)
from vllm_moa.serving.round_order import RoundOrder
from vllm_moa.serving.security import AuthMiddleware, BearerAuth, BodyLimitMiddleware, check_exposure, client_key
from vllm_moa.serving.sessions import SessionStore, Slot

log = logging.getLogger("vllm_moa.serving")

SessionId = Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 422, 429, 503)}


def create_app(backend: TargetBackend, limits: ServerLimits | None = None, tokens: list[str] | None = None,
               clock: Callable[[], float] = time.monotonic, reap_every_s: float | None = None) -> FastAPI:
    limits = limits or ServerLimits()
    auth = BearerAuth(tokens or [])
    store = SessionStore(limits, clock)
    rounds = RoundOrder(limits)
    period = reap_every_s or max(0.5, min(limits.session_idle_ttl_s / 4, 30.0))
    # the longest sequence served: the target's context window, capped by the configured limit
    # (a target that declares no window is bounded by the limit alone)
    window = min(w for w in (backend.context_window, limits.max_session_tokens) if w is not None)

    def close_all(sessions: list) -> None:
        for session in sessions:
            backend.close(session)  # takes the session's lock: waits for a verify in flight

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def reaper() -> None:
            while True:
                await asyncio.sleep(period)
                expired = store.reap()
                if expired:
                    await run_in_threadpool(close_all, expired)

        task = asyncio.create_task(reaper())
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(title="vllm-moa verification server", version=PROTOCOL, lifespan=lifespan,
                  description="Mixture-of-Attentions client-server speculative decoding: the client drafts, "
                              "this server verifies with the target and keeps the client's drafter in sync.")
    metrics = ServerMetrics(store)
    app.state.store, app.state.backend, app.state.limits, app.state.auth = store, backend, limits, auth
    app.state.metrics = metrics
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_body_bytes)
    app.add_middleware(AuthMiddleware, auth=auth)  # nothing is read before the token is checked
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: refusals by auth are counted too

    @app.exception_handler(BackendError)
    async def _backend_error(request: Request, err: BackendError) -> JSONResponse:
        return JSONResponse({"error": str(err)}, status_code=err.status, headers=err.headers or None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        problems = []
        for e in err.errors()[:5]:
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {e.get('msg', 'invalid')}")
        return JSONResponse({"error": "invalid request: " + "; ".join(problems)}, status_code=422)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse({"error": str(err.detail)}, status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse({"error": f"internal error ({type(err).__name__})"}, status_code=500)

    def too_long(what: str, tokens: int) -> BackendError:
        return BackendError(f"{what} would hold {tokens} tokens; this server keeps at most {window} per sequence "
                            f"(the target's context window capped by max_session_tokens)", status=413)

    def check_prompt(prompt: list[int]) -> None:
        if len(prompt) > limits.max_prompt_tokens:
            raise BackendError(f"prompt has {len(prompt)} tokens; this server accepts at most "
                               f"{limits.max_prompt_tokens}", status=413)

    @app.get("/v1/health")
    async def health():  # async: answered on the event loop, never behind busy workers
        problem = backend.healthy()
        if problem is not None:
            return JSONResponse({"status": "unavailable", "error": problem, "protocol": PROTOCOL}, status_code=503)
        return {"status": "ok", "protocol": PROTOCOL}

    @app.get("/metrics", response_class=Response, responses=_ERRORS)
    async def prometheus_metrics(client: str = Depends(client_key)) -> Response:  # behind the bearer token
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/info", response_model=InfoResponse, responses=_ERRORS)
    async def info(client: str = Depends(client_key)) -> InfoResponse:
        return InfoResponse(protocol=PROTOCOL, backend=backend.name, target=backend.signature.to_dict(),
                            context_window=window, drafters=backend.drafters(), limits=limits,
                            kv_block_size=backend.round_block_size)

    # Handlers are async: validation, auth and admission run on the event loop and answer at once,
    # even when every worker thread waits for the target; only target work goes to a worker.
    @app.post("/v1/sessions", response_model=OpenResponse, responses=_ERRORS)
    async def open_session(request: OpenRequest, client: str = Depends(client_key)) -> OpenResponse:
        check_prompt(request.prompt)
        if len(request.prompt) + 1 > window:  # the prompt and the target's next token
            raise too_long("the session", len(request.prompt) + 1)
        with store.reserve(client, len(request.prompt)) as slot:
            session, response = await run_in_threadpool(backend.open, request)
            session_id = store.add(slot, session)
        return response.model_copy(update={"session_id": session_id, "idle_ttl_s": limits.session_idle_ttl_s})

    @app.post("/v1/sessions/{session_id}/verify", response_model=VerifyResponse, responses=_ERRORS)
    async def verify(request: VerifyRequest, session_id: str = SessionId,
                     client: str = Depends(client_key)) -> VerifyResponse:
        nodes = len(request.tree.tokens)
        if nodes - 1 > limits.max_draft_nodes:
            raise BackendError(f"the draft has {nodes - 1} nodes; this server verifies at most "
                               f"{limits.max_draft_nodes} per request", status=413)
        depth = max(request.tree.depths())
        if request.seq + depth + 1 > window:  # the accepted path can reach seq + depth + 1 tokens
            raise too_long(f"a draft of depth {depth} at position {request.seq}", request.seq + depth + 1)
        session = store.get(client, session_id)  # in flight until settle(): never reaped meanwhile
        try:
            await rounds.wait_turn(session, request)  # a pipelined round: after the round it follows
            store.charge(session_id, request.seq + nodes)  # the draft's K/V is written after the root's position
            response = await run_in_threadpool(backend.verify, session, request)
        finally:
            store.settle(session_id, len(session.tokens))
            if request.round is not None:
                await rounds.answered()
        metrics.verified(nodes - 1, len(response.accepted))
        return response

    @app.delete("/v1/sessions/{session_id}", responses=_ERRORS)
    async def close_session(session_id: str = SessionId, client: str = Depends(client_key)) -> dict:
        await run_in_threadpool(backend.close, store.remove(client, session_id))
        await rounds.answered()  # its pipelined rounds stop waiting (and find it closed)
        return {"closed": session_id}

    @app.post("/v1/generate", response_model=GenerateResponse, responses=_ERRORS)
    async def generate(request: GenerateRequest, client: str = Depends(client_key)):
        check_prompt(request.prompt)
        if request.max_tokens > limits.max_new_tokens:
            raise BackendError(f"max_tokens={request.max_tokens} exceeds this server's limit of "
                               f"{limits.max_new_tokens}", status=413)
        length = len(request.prompt) + request.max_tokens
        if length > window:
            raise too_long(f"prompt ({len(request.prompt)} tokens) + max_tokens={request.max_tokens}", length)
        slot = store.admit_generation(client, length)
        try:
            started = time.perf_counter()
            tokens = backend.generate(request)  # validates before the first token
            first = await run_in_threadpool(next, tokens)  # before answering: a failure here still gets its status
        except BaseException:
            slot.release()
            raise
        if request.stream:
            return _TokenStream(_ndjson(first, tokens, request.eos_token_id, started,
                                        metrics.generated_tokens.inc), slot)
        try:
            out = [first, *await run_in_threadpool(list, tokens)]
        finally:
            slot.release()
        metrics.generated_tokens.inc(len(out))
        return GenerateResponse(tokens=out, finish_reason=_finish(out, request.eos_token_id),
                                server_ms=1e3 * (time.perf_counter() - started))

    return app


def _finish(tokens: list[int], eos: int | None) -> str:
    return "eos" if tokens and eos is not None and tokens[-1] == eos else "length"


def _ndjson(first: int, tokens: Iterator[int], eos: int | None, started: float,
            count: Callable[[], None]) -> Iterator[bytes]:
    """One line per token (`count()` once for each), then a closing line with the finish reason; a
    failure mid-way ends the stream with an {"error": ...} line (the status line has gone out already)."""
    out = [first]
    try:
        count()
        yield (json.dumps({"tokens": [first]}) + "\n").encode()
        for token in tokens:
            out.append(token)
            count()
            yield (json.dumps({"tokens": [token]}) + "\n").encode()
        yield (json.dumps({"done": True, "finish_reason": _finish(out, eos),
                           "server_ms": 1e3 * (time.perf_counter() - started)}) + "\n").encode()
    except Exception as err:  # noqa: BLE001 - reported to the client in-band, logged here
        log.exception("unexpected error while streaming a generation")
        yield (json.dumps({"error": f"internal error ({type(err).__name__})"}) + "\n").encode()
    finally:
        tokens.close()  # the generation stops here and frees its cache


class _TokenStream(StreamingResponse):
    """A streamed generation. However the response ends (done, failed, or the client hung up),
    the generation is closed and its admission slot given back at once, not whenever the garbage
    collector finds the abandoned iterator."""

    def __init__(self, lines: Iterator[bytes], slot: Slot) -> None:
        super().__init__(lines, media_type="application/x-ndjson")
        self._lines, self._slot = lines, slot

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slot.release()
            with contextlib.suppress(ValueError):  # "generator already executing": it ends by itself
                self._lines.close()


# -- running it -------------------------------------------------------------------------------
def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          insecure: bool = False) -> None:
    """Run the app with uvicorn until interrupted (HTTP/1.1 keep-alive). Without bearer tokens it
    listens only on loopback unless `insecure` (security.check_exposure)."""
    import uvicorn

    check_exposure(host, app.state.auth.enabled, insecure)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=75)


class ServerThread:
    """Run an app with uvicorn on 127.0.0.1 (a free port unless given) in a daemon thread.

    with ServerThread(app) as url:   # "http://127.0.0.1:PORT"
        ...
    """

    def __init__(self, app: FastAPI, port: int = 0, log_level: str = "warning") -> None:
        import uvicorn

        # proto=IPPROTO_TCP: asyncio then sets TCP_NODELAY on accepted connections (with proto 0 it does
        # not, and every keep-alive response waits ~40 ms on Nagle + delayed ACK)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level=log_level, timeout_keep_alive=75, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name=f"uvicorn-{self.port}")

    def start(self, timeout: float = 30.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on port {self.port} did not start")
            time.sleep(0.01)
        return self.url

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
