"""server_load.py's bookkeeping: what every request returned (per route and client kind), the
server's memory over time, the summary and the plot."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

KINDS = ("draft-chain", "draft-tree", "verify-raw", "generate", "generate-stream", "stream-disconnect", "abandon",
         "hostile")
ROUTES = ("health", "info", "open", "verify", "close", "generate", "generate-stream")
REFUSALS = (429, 503)
TIMEOUT_S = 120.0  # per request: far beyond any expected wait, so a timeout means a stall


class LoadTestFailed(AssertionError):
    """The load test found a failure (the results file is written first)."""


# -- bookkeeping --------------------------------------------------------------------------------
def route_of(method: str, path: str, stream: bool) -> str:
    if path == "/v1/health":
        return "health"
    if path == "/v1/info":
        return "info"
    if path == "/v1/generate":
        return "generate-stream" if stream else "generate"
    if path == "/v1/sessions":
        return "open"
    if path.endswith("/verify"):
        return "verify"
    if method == "DELETE":
        return "close"
    return path


class Recorder:
    """Every HTTP exchange of every client (wrapped httpx.Client.send): time, route, status or
    transport error, latency (to the response headers for streams, the whole answer otherwise)."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.lock = threading.Lock()
        self.rows: list[tuple] = []  # (t, route, status | None, seconds, error | None, deliberate)
        self.failures: list[str] = []
        self.completed: Counter[str] = Counter()  # outputs checked equal to greedy, per client kind
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (kind, outcome)
        self.generation_s: dict[str, list[float]] = defaultdict(list)
        self.hostile: Counter[str] = Counter()  # hostile requests sent, per case
        # .deliberate: the next request may be aborted by its client; .hostile: it is meant to be refused
        self.local = threading.local()

    def fail(self, message: str) -> None:
        with self.lock:
            self.failures.append(message)

    def outcome(self, kind: str, what: str, seconds: float | None = None) -> None:
        with self.lock:
            self.outcomes[(kind, what)] += 1
            if what == "exact":
                self.completed[kind] += 1
                if seconds is not None:
                    self.generation_s[kind].append(seconds)

    def wrap(self, http):
        """Record every request `http` (an httpx.Client) sends."""
        import httpx

        send = http.send

        def recorded(request, *, stream=False, **kwargs):
            route = route_of(request.method, request.url.path, stream)
            deliberate = getattr(self.local, "deliberate", False)
            t0 = time.perf_counter()
            try:
                response = send(request, stream=stream, **kwargs)
            except httpx.HTTPError as err:
                self._add(t0, route, None, f"{type(err).__name__}", deliberate)
                if not deliberate:
                    self.fail(f"{route}: transport error {type(err).__name__}: {err}")
                raise
            self._add(t0, route, response.status_code, None, deliberate)
            status = response.status_code
            if status >= 500 and status != 503:
                body = "" if stream else response.text[:300]
                self.fail(f"{route}: server error {status} {body}")
            elif status == 503 and not stream and ("retry-after" not in response.headers
                                                  or "error" not in response_json(response)):
                self.fail(f"{route}: 503 without Retry-After or error message: {response.text[:200]}")
            elif status in (404, 409) and _pipelined(request):
                pass  # a round sent before its predecessor's verdict, which made it moot (409), or
                # arriving after the generation ended and closed its session (404)
            elif status >= 400 and status not in REFUSALS and not getattr(self.local, "hostile", False):
                self.fail(f"{route}: unexpected refusal {status} {'' if stream else response.text[:300]}")
            return response

        http.send = recorded
        return http

    def _add(self, t0: float, route: str, status: int | None, error: str | None, deliberate: bool) -> None:
        now = time.perf_counter()
        with self.lock:
            self.rows.append((round(t0 - self.started, 4), route, status, now - t0, error, deliberate))


def response_json(response) -> dict:
    try:
        data = response.json()
        return data if isinstance(data, dict) else {}
    except ValueError:
        return {}


def rss_bytes(pid: int, tree: bool = True) -> int | None:
    """The RSS of `pid` and (tree) every process under it (the vLLM backend's engine core and worker)."""
    try:
        import psutil

        process = psutil.Process(pid)
        total = process.memory_info().rss
        for child in process.children(recursive=True) if tree else ():
            try:
                total += child.memory_info().rss
            except psutil.Error:
                pass
        return total
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - the process is gone
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class MemorySampler(threading.Thread):
    def __init__(self, pid: int, started: float, period: float = 0.5) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.pid, self.started, self.period = pid, started, period
        self.samples: list[tuple[float, float]] = []  # (seconds since start, MiB): the process tree
        self.own_samples: list[tuple[float, float]] = []  # the server process alone
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            rss = rss_bytes(self.pid)
            if rss is not None:
                t = round(time.perf_counter() - self.started, 2)
                self.samples.append((t, round(rss / 2**20, 2)))
                own = rss_bytes(self.pid, tree=False)
                if own is not None:
                    self.own_samples.append((t, round(own / 2**20, 2)))
            self.stop.wait(self.period)

    def latest(self) -> float | None:
        return self.samples[-1][1] if self.samples else None


# -- summary and plot ------------------------------------------------------------------------------------
def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    values = sorted(values)

    def q(p: float) -> float:
        k = (len(values) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(values) - 1)
        return values[lo] + (values[hi] - values[lo]) * (k - lo)

    return {"n": len(values), "p50": round(1e3 * q(0.5), 2), "p90": round(1e3 * q(0.9), 2),
            "p99": round(1e3 * q(0.99), 2), "max": round(1e3 * values[-1], 2)}


def summarize(rec: Recorder, load_s: tuple[float, float], until: float | None = None) -> dict:
    """load_s: the load phase (start, end), seconds since the server was launched; until: the end
    of the load's drain (the issue's status_5xx counts up to it: the leak check after it asks for
    two 503s on purpose)."""
    rows = list(rec.rows)
    by_route: dict[str, Counter] = defaultdict(Counter)
    latency: dict[str, list[float]] = defaultdict(list)
    refusal_latency: list[float] = []
    status = Counter()
    errors = Counter()
    for _t, route, code, seconds, error, deliberate in rows:
        key = str(code) if code is not None else ("aborted by client" if deliberate else f"error:{error}")
        by_route[route][key] += 1
        status[key] += 1
        if code is not None and 200 <= code < 300:
            latency[route].append(seconds)
        elif code in REFUSALS:
            refusal_latency.append(seconds)
        if code is None and not deliberate:
            errors[error] += 1
    start, end = load_s
    in_load = [r for r in rows if start <= r[0] <= end]
    five = sum(1 for r in rows if r[2] is not None and r[2] >= 500 and (until is None or r[0] <= until))
    return {
        # the integer keys: every request, the hostile ones, streams the client hung up on,
        # every 5xx (503 refusals included), greedy outputs that differ from the reference
        "summary": {"requests": len(rows), "bad_requests": sum(rec.hostile.values()),
                    "disconnects": sum(n for (k, o), n in rec.outcomes.items()
                                       if k == "stream-disconnect" and o.startswith("hung-up")),
                    "status_5xx": five,
                    "mismatches": sum(n for (_, o), n in rec.outcomes.items() if o == "mismatch")},
        "bad_requests_by_case": dict(sorted(rec.hostile.items())),
        "requests": len(rows),
        "requests_per_s_during_load": round(len(in_load) / max(end - start, 1e-9), 1),
        "status_counts": dict(sorted(status.items())),
        "status_counts_by_route": {r: dict(sorted(c.items())) for r, c in sorted(by_route.items())},
        "server_errors_5xx_other_than_503": sum(n for k, n in status.items() if k.isdigit() and int(k) >= 500
                                                and int(k) != 503),
        "refusals": {"429": status.get("429", 0), "503": status.get("503", 0),
                     "latency_ms": _percentiles(refusal_latency)},
        "transport_errors_not_deliberate": dict(errors),
        "deliberate_client_aborts": sum(1 for r in rows if r[5] and r[2] is None),
        "latency_ms_2xx": {r: _percentiles(latency[r]) for r in ROUTES if latency.get(r)},
        "completed_exact_by_kind": {k: rec.completed.get(k, 0) for k in KINDS},
        "outcomes_by_kind": {k: {o: n for (kk, o), n in sorted(rec.outcomes.items()) if kk == k} for k in KINDS},
        "generation_seconds_by_kind": {k: _percentiles(v) for k, v in rec.generation_s.items()},
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    ax = axes[0]
    routes = list(s["latency_ms_2xx"])
    width = 0.27
    for j, p in enumerate(("p50", "p90", "p99")):
        ax.bar([i + (j - 1) * width for i in range(len(routes))], [s["latency_ms_2xx"][r][p] for r in routes], width,
               label=p)
    ax.set_xticks(range(len(routes)), routes, rotation=20, fontsize=8)
    ax.set(yscale="log", ylabel="latency (ms), 2xx answers", title="Latency per route (to headers for streams)")
    ax.legend()
    ax = axes[1]
    samples = result["rss_mb"]["samples"]
    if samples:
        ax.plot([t for t, _ in samples], [m for _, m in samples], color="C3")
    phases = result["phases_s"]
    ax.axvspan(phases["load_start"], phases["load_end"], color="C0", alpha=0.12, label="load")
    ax.axvspan(phases["drain_end"], phases["leak_check_end"], color="C2", alpha=0.12,
               label="idle TTL wait, then leak check")
    ax.set(xlabel="seconds since the server started", ylabel="server RSS (MiB)", title="Server memory")
    ax.legend()
    ax = axes[2]
    per_s_ok, per_s_refused = Counter(), Counter()
    for t, code in result["request_timeline"]:
        (per_s_ok if code is not None and code < 300 else per_s_refused)[int(t)] += 1
    end = int(phases["leak_check_end"]) + 1
    ax.plot(range(end), [per_s_ok[i] for i in range(end)], label="2xx")
    ax.plot(range(end), [per_s_refused[i] for i in range(end)], label="429 / 503 / aborted")
    ax.set(xlabel="seconds since the server started", ylabel="requests per second", title="Throughput")
    ax.legend()
    cfg = result["config"]
    models = "SmolLM2-135M-Instruct" if cfg.get("target") == "smollm2" else "the demo models"
    fig.suptitle(f"vllm-moa server under load: {cfg['clients']} clients for {cfg['duration_s']:.0f} s on {models} "
                 f"(CPU, loopback); {s['requests']} requests, "
                 f"{s['server_errors_5xx_other_than_503']} 5xx (other than 503), "
                 f"{s['refusals']['429']} x 429, {s['refusals']['503']} x 503")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pipelined(request) -> bool:
    """A verify request the client sent before the verdict of the round ahead (body `after` set)."""
    try:
        return request.url.path.endswith("/verify") and json.loads(request.content).get("after") is not None
    except (ValueError, AttributeError):
        return False
