"""The verification server: a FastAPI app over a `TargetBackend` (protocol.py lists the routes).

Handlers are plain functions (FastAPI runs them in its thread pool); the backend serialises target
forwards, so many sessions interleave round by round. Every refusal is a 4xx with
{"error": message}; anything unexpected is logged and answered 500 without killing the server.

    create_app(backend, limits, tokens)   the ASGI app
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
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException  # routing's 404/405 too, not only FastAPI's own

from vllm_moa.serving.backend import BackendError, TargetBackend
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
from vllm_moa.serving.security import BearerAuth, BodyLimitMiddleware
from vllm_moa.serving.sessions import SessionStore

log = logging.getLogger("vllm_moa.serving")

SessionId = Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 422, 429)}


def create_app(backend: TargetBackend, limits: ServerLimits | None = None, tokens: list[str] | None = None,
               clock: Callable[[], float] = time.monotonic, reap_every_s: float | None = None) -> FastAPI:
    limits = limits or ServerLimits()
    auth = BearerAuth(tokens or [])
    store = SessionStore(limits, clock)
    period = reap_every_s or max(0.5, min(limits.session_idle_ttl_s / 4, 30.0))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def reaper() -> None:
            while True:
                await asyncio.sleep(period)
                for session in store.reap():
                    backend.close(session)

        task = asyncio.create_task(reaper())
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(title="vllm-moa verification server", version=PROTOCOL, lifespan=lifespan,
                  description="Mixture-of-Attentions client-server speculative decoding: the client drafts, "
                              "this server verifies with the target and keeps the client's drafter in sync.")
    app.state.store, app.state.backend, app.state.limits = store, backend, limits
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_body_bytes)

    @app.exception_handler(BackendError)
    async def _backend_error(request: Request, err: BackendError) -> JSONResponse:
        return JSONResponse({"error": str(err)}, status_code=err.status)

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

    @app.get("/v1/health")
    def health() -> dict:
        return {"status": "ok", "protocol": PROTOCOL}

    @app.get("/v1/info", response_model=InfoResponse, responses=_ERRORS)
    def info(client: str = Depends(auth)) -> InfoResponse:
        return InfoResponse(protocol=PROTOCOL, backend=backend.name, target=backend.signature.to_dict(),
                            context_window=backend.context_window, drafters=backend.drafters(), limits=limits)

    @app.post("/v1/sessions", response_model=OpenResponse, responses=_ERRORS)
    def open_session(request: OpenRequest, client: str = Depends(auth)) -> OpenResponse:
        if len(request.prompt) > limits.max_prompt_tokens:
            raise BackendError(f"prompt has {len(request.prompt)} tokens; this server accepts at most "
                               f"{limits.max_prompt_tokens}", status=413)
        with store.reserve(client):
            session, response = backend.open(request)
            session_id = store.add(client, session)
        return response.model_copy(update={"session_id": session_id, "idle_ttl_s": limits.session_idle_ttl_s})

    @app.post("/v1/sessions/{session_id}/verify", response_model=VerifyResponse, responses=_ERRORS)
    def verify(request: VerifyRequest, session_id: str = SessionId, client: str = Depends(auth)) -> VerifyResponse:
        drafted = len(request.tree.tokens) - 1
        if drafted > limits.max_draft_nodes:
            raise BackendError(f"the draft has {drafted} nodes; this server verifies at most "
                               f"{limits.max_draft_nodes} per request", status=413)
        return backend.verify(store.get(client, session_id), request)

    @app.delete("/v1/sessions/{session_id}", responses=_ERRORS)
    def close_session(session_id: str = SessionId, client: str = Depends(auth)) -> dict:
        backend.close(store.remove(client, session_id))
        return {"closed": session_id}

    @app.post("/v1/generate", response_model=GenerateResponse, responses=_ERRORS)
    def generate(request: GenerateRequest, client: str = Depends(auth)):
        if len(request.prompt) > limits.max_prompt_tokens:
            raise BackendError(f"prompt has {len(request.prompt)} tokens; this server accepts at most "
                               f"{limits.max_prompt_tokens}", status=413)
        if request.max_tokens > limits.max_new_tokens:
            raise BackendError(f"max_tokens={request.max_tokens} exceeds this server's limit of "
                               f"{limits.max_new_tokens}", status=413)
        started = time.perf_counter()
        tokens = backend.generate(request)  # validates before the first token
        if request.stream:
            return StreamingResponse(_ndjson(tokens, request.eos_token_id, started),
                                     media_type="application/x-ndjson")
        out = list(tokens)
        return GenerateResponse(tokens=out, finish_reason=_finish(out, request.eos_token_id),
                                server_ms=1e3 * (time.perf_counter() - started))

    return app


def _finish(tokens: list[int], eos: int | None) -> str:
    return "eos" if tokens and eos is not None and tokens[-1] == eos else "length"


def _ndjson(tokens: Iterator[int], eos: int | None, started: float) -> Iterator[bytes]:
    """One line per token, then a closing line with the finish reason."""
    out = []
    for token in tokens:
        out.append(token)
        yield (json.dumps({"tokens": [token]}) + "\n").encode()
    yield (json.dumps({"done": True, "finish_reason": _finish(out, eos),
                       "server_ms": 1e3 * (time.perf_counter() - started)}) + "\n").encode()


# -- running it -------------------------------------------------------------------------------
def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run the app with uvicorn until interrupted (HTTP/1.1 keep-alive)."""
    import uvicorn

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
