"""The verification server's Prometheus metrics (prometheus-client), served at GET /metrics.

Each app has its own `CollectorRegistry`, so several servers in one process (tests, benchmarks)
never mix their counts. What is counted:

    vllm_moa_http_requests_total{route, status}    every answered request, by route template and status
    vllm_moa_http_request_seconds{route}           latency of every answered request (histogram)
    vllm_moa_verify_draft_tokens_total             draft nodes sent for verification (root excluded)
    vllm_moa_verify_accepted_tokens_total          of those, accepted
    vllm_moa_verify_rounds_total                   verification rounds answered
    vllm_moa_generated_tokens_total                tokens produced by /v1/generate (streamed or whole)
    vllm_moa_sessions_open                         sessions held now (read from the session store)
    vllm_moa_tokens_held                           tokens charged against the server's token budget now
    vllm_moa_generations_running                   /v1/generate calls admitted and not finished

Route labels are the route templates (`/v1/sessions/{session_id}/verify`), never raw paths, so a
client cannot grow the label set; requests that match no route are counted under "unmatched".
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.routing import Match

from vllm_moa.serving.sessions import SessionStore

UNMATCHED = "unmatched"
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The counters, histograms and gauges of one server app."""

    def __init__(self, store: SessionStore) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("vllm_moa_http_requests", "Requests answered, by route template and status",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram("vllm_moa_http_request_seconds", "Time to answer a request (to its last byte)",
                                 ["route"], buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.draft_tokens = Counter("vllm_moa_verify_draft_tokens", "Draft nodes sent for verification",
                                    registry=self.registry)
        self.accepted_tokens = Counter("vllm_moa_verify_accepted_tokens", "Draft tokens accepted by verification",
                                       registry=self.registry)
        self.rounds = Counter("vllm_moa_verify_rounds", "Verification rounds answered", registry=self.registry)
        self.generated_tokens = Counter("vllm_moa_generated_tokens", "Tokens produced by /v1/generate",
                                        registry=self.registry)
        Gauge("vllm_moa_sessions_open", "Sessions held now", registry=self.registry).set_function(
            lambda: store.count(None))
        Gauge("vllm_moa_tokens_held", "Tokens charged against the token budget now",
              registry=self.registry).set_function(store.tokens_held)
        Gauge("vllm_moa_generations_running", "/v1/generate calls admitted and not finished",
              registry=self.registry).set_function(store.generations)

    def verified(self, draft_nodes: int, accepted: int) -> None:
        self.rounds.inc()
        self.draft_tokens.inc(draft_nodes)
        self.accepted_tokens.inc(accepted)

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """ASGI middleware: count every HTTP request by route template and status, and time it to the
    end of its response body (streams included)."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = _route_template(scope)
        started = time.perf_counter()
        status = 500  # what the server answers when the app raises before its response starts

        async def send_and_record(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)


def _route_template(scope) -> str:
    app = scope.get("app")
    for route in getattr(getattr(app, "router", None), "routes", ()):
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return getattr(route, "path", UNMATCHED)
    return UNMATCHED
