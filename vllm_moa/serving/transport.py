"""The client's HTTP transport (httpx): one connection pool, byte counts, refusals (4xx) told
apart from failures the network may have caused (retried by the client) and from sessions the
server no longer has (reopened)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator

import httpx
from pydantic import BaseModel, ValidationError

from vllm_moa.serving.payload import PayloadError
from vllm_moa.serving.stream import ProtocolError, RequestRefused


class TransientFailure(Exception):
    """A failure the network may have caused: retry."""


class StaleSession(Exception):
    """The server no longer has the session as the client knows it: reopen."""


class Transport:
    """httpx with keep-alive; failures classified as transient (retry), stale (reopen) or refused."""

    def __init__(self, url: str, token: str | None, timeout: float, connect_timeout: float) -> None:
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers,
                                 timeout=httpx.Timeout(timeout, connect=connect_timeout))
        self.calls = self.bytes_sent = self.bytes_received = 0
        self._counting = threading.Lock()  # requests may run from several threads (pipelined rounds)

    def close(self) -> None:
        self.http.close()

    def _count_request(self, request: httpx.Request, body: bytes) -> None:
        line = len(request.method) + len(request.url.raw_path) + 12
        with self._counting:
            self.calls += 1
            self.bytes_sent += line + sum(len(k) + len(v) + 4 for k, v in request.headers.raw) + 2 + len(body)

    def _count_response(self, response: httpx.Response, body_bytes: int) -> None:
        with self._counting:
            self.bytes_received += 17 + sum(len(k) + len(v) + 4 for k, v in response.headers.raw) + 2 + body_bytes

    def call(self, method: str, path: str, body: dict | None, model: type[BaseModel] | None,
             stale: tuple[int, ...] = ()) -> BaseModel | dict:
        content = json.dumps(body).encode() if body is not None else b""
        request = self.http.build_request(method, path, content=content or None)
        self._count_request(request, content)
        try:
            response = self.http.send(request)
        except httpx.RequestError as err:
            raise TransientFailure(f"{type(err).__name__}: {err}") from None
        self._count_response(response, len(response.content))
        if response.status_code >= 500:
            raise TransientFailure(f"server error {response.status_code}")
        if response.status_code in stale:
            raise StaleSession(_message(response))
        if response.status_code >= 400:
            raise RequestRefused(response.status_code, _message(response))
        try:
            return model.model_validate_json(response.content) if model is not None else response.json()
        except (ValidationError, ValueError) as err:
            raise TransientFailure(f"malformed response: {err}") from None

    def stream_lines(self, path: str, body: dict) -> Iterator[dict]:
        content = json.dumps(body).encode()
        request = self.http.build_request("POST", path, content=content)
        self._count_request(request, content)
        try:
            response = self.http.send(request, stream=True)
        except httpx.RequestError as err:
            raise TransientFailure(f"{type(err).__name__}: {err}") from None
        try:
            if response.status_code >= 400:
                response.read()
                self._count_response(response, len(response.content))
                if response.status_code >= 500:
                    raise TransientFailure(f"server error {response.status_code}")
                raise RequestRefused(response.status_code, _message(response))
            self._count_response(response, 0)
            for line in response.iter_lines():
                self.bytes_received += len(line) + 1
                if line.strip():
                    try:
                        data = json.loads(line)
                    except ValueError as err:
                        raise TransientFailure(f"malformed stream line: {err}") from None
                    if not isinstance(data, dict):
                        raise TransientFailure(f"malformed stream line: {line[:100]!r}")
                    if "error" in data:  # the server failed mid-stream (its status line had gone out)
                        raise TransientFailure(f"server error mid-stream: {data['error']}")
                    yield data
        except httpx.RequestError as err:
            raise TransientFailure(f"{type(err).__name__}: {err}") from None
        finally:
            response.close()


@contextlib.contextmanager
def payload_errors() -> Iterator[None]:
    """A sync payload the drafter cannot use is the server's fault: ProtocolError."""
    try:
        yield
    except PayloadError as err:
        raise ProtocolError(f"unusable sync payload: {err}") from None


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error", response.text))
    except (ValueError, AttributeError):
        return response.text[:500]
