"""Who may call the server, from where, and how much they may send.

* Bearer tokens: when tokens are configured every route but /v1/health (the API, the OpenAPI
  document and the /docs and /redoc pages included) needs `Authorization: Bearer <token>`, checked
  by a raw ASGI middleware before anything reads or parses the request body (no token: 401, not
  422). Tokens are compared in constant time (hmac.compare_digest over sha256 digests, every
  configured token checked). The token's index names the client for the per-client limits; without
  tokens the client is its remote address.
* Exposure: a server without tokens listens only on a loopback address unless the operator says
  `insecure` (check_exposure; `vllm-moa serve --insecure`).
* Body limit: a raw ASGI middleware refuses a body larger than `max_bytes` with 413 before
  anything parses it: at once from Content-Length, or as soon as a chunked body passes the limit.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
from pathlib import Path

from fastapi import HTTPException, Request

OPEN_PATHS = frozenset({"/v1/health"})  # answered without a token


def load_tokens(token: str | None = None, token_file: str | Path | None = None,
                env: str = "VLLM_MOA_TOKEN") -> list[str]:
    """Tokens from an explicit value, a file (one per line, '#' comments) or the environment
    (comma-separated). Empty tokens are refused: they would authenticate everyone."""
    tokens: list[str] = []
    if token:
        tokens.append(token)
    if token_file:
        for line in Path(token_file).read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                tokens.append(line)
    if not tokens and os.environ.get(env):
        tokens = [t.strip() for t in os.environ[env].split(",") if t.strip()]
    for t in tokens:
        if len(t) < 8:
            raise ValueError("bearer tokens must be at least 8 characters long")
    return tokens


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, auth_enabled: bool, insecure: bool = False) -> None:
    """Refuse to listen beyond loopback without bearer tokens, unless `insecure` says so."""
    if not auth_enabled and not insecure and not is_loopback(host):
        raise ValueError(f"refusing to listen on {host} without bearer tokens: anyone who can reach it could use the "
                         "target. Set tokens (VLLM_MOA_TOKEN or --token-file), listen on 127.0.0.1, or pass --insecure "
                         "if this network is trusted")


class Unauthorized(Exception):
    """No valid bearer token: answered 401 with the reason."""


class BearerAuth:
    """Maps a request's Authorization header (or, without tokens, its address) to a client key."""

    def __init__(self, tokens: list[str]) -> None:
        self._digests = [hashlib.sha256(t.encode()).digest() for t in tokens]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def identify(self, authorization: str, host: str) -> str:
        """The client key, or Unauthorized with the reason."""
        if not self._digests:
            return f"addr:{host}"
        scheme, _, credential = authorization.partition(" ")
        if scheme.lower() != "bearer" or not credential.strip():
            raise Unauthorized("missing bearer token (Authorization: Bearer <token>)")
        digest = hashlib.sha256(credential.strip().encode("utf-8", "surrogateescape")).digest()
        match = -1
        for index, known in enumerate(self._digests):  # no early exit: same work for every token
            if hmac.compare_digest(digest, known):
                match = index
        if match < 0:
            raise Unauthorized("invalid bearer token")
        return f"token:{match}"


class AuthMiddleware:
    """Authenticate every HTTP request but OPEN_PATHS before the application sees it (so before its
    body is read); the client key goes to `request.state.client` (`client_key` below)."""

    def __init__(self, app, auth: BearerAuth) -> None:
        self.app, self.auth = app, auth

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            header = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
            host = scope["client"][0] if scope.get("client") else "unknown"
            try:
                client = self.auth.identify(header.decode("latin-1"), host)
            except Unauthorized as err:
                if scope.get("path") not in OPEN_PATHS:
                    await _reply(send, 401, str(err), [(b"www-authenticate", b"Bearer")])
                    return
                client = "anonymous"
            scope.setdefault("state", {})["client"] = client
        await self.app(scope, receive, send)


async def client_key(request: Request) -> str:
    """FastAPI dependency: the client key AuthMiddleware established (async: no worker thread)."""
    return request.state.client


class _BodyTooLarge(HTTPException):
    """Raised from `receive` mid-body; an HTTPException so that FastAPI's body reader re-raises it
    as is (it turns any other exception into a 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the server's limit of {limit} bytes")


class BodyLimitMiddleware:
    """Refuse request bodies over `max_bytes` with 413, before the application reads them."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = None
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await _reply(send, 400, "invalid Content-Length header")
                    return
        if length is not None and length > self.max_bytes:
            await _reply(send, 413, f"request body of {length} bytes exceeds the server's limit of {self.max_bytes}")
            return
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _reply(send, 413, f"request body exceeds the server's limit of {self.max_bytes} bytes")


async def _reply(send, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})
