"""Who may call the server, and how much they may send.

* Bearer tokens: when tokens are configured every /v1 route but /v1/health needs
  `Authorization: Bearer <token>`; tokens are compared in constant time (hmac.compare_digest over
  sha256 digests, every configured token checked). The token's index names the client for the
  per-client session limit; without tokens the client is its remote address.
* Body limit: a raw ASGI middleware refuses a body larger than `max_body_bytes` with 413 before
  anything parses it: at once from Content-Length, or as soon as a chunked body passes the limit.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

from fastapi import HTTPException, Request


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


class BearerAuth:
    """FastAPI dependency: returns the client key of an authorised request, raises 401 otherwise."""

    def __init__(self, tokens: list[str]) -> None:
        self._digests = [hashlib.sha256(t.encode()).digest() for t in tokens]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __call__(self, request: Request) -> str:
        if not self._digests:
            host = request.client.host if request.client else "unknown"
            return f"addr:{host}"
        header = request.headers.get("authorization", "")
        scheme, _, credential = header.partition(" ")
        if scheme.lower() != "bearer" or not credential.strip():
            raise HTTPException(401, "missing bearer token (Authorization: Bearer <token>)",
                                headers={"WWW-Authenticate": "Bearer"})
        digest = hashlib.sha256(credential.strip().encode("utf-8", "surrogateescape")).digest()
        match = -1
        for index, known in enumerate(self._digests):  # no early exit: same work for every token
            if hmac.compare_digest(digest, known):
                match = index
        if match < 0:
            raise HTTPException(401, "invalid bearer token", headers={"WWW-Authenticate": "Bearer"})
        return f"token:{match}"


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


async def _reply(send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
