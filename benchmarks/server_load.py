"""A bounded load test of the verification server on loopback (issue 14, reliability).

The real server (`vllm-moa serve`: the FastAPI app of vllm_moa/serving/server.py under uvicorn, the
shipped demo target and its MoA drafters, 1 torch thread) runs in a subprocess on 127.0.0.1 with
limits small enough that admission control is exercised: a few sessions and generations per
client, a server-wide session count, a token budget and a short idle TTL. Every client has its own
bearer token, so per-client limits (429) and server-wide limits (503 + Retry-After) both happen.
For `--duration` seconds, `--clients` threads in this process (1 torch thread) load it, each of one
kind (round robin):

  draft-chain        RemoteDraftingClient with the shipped MoA drafter (moa-tli0), chains (fixed
                     or adaptive depth, fp16 or int8 rows)
  draft-tree         the same with EAGLE-2 trees (moa-tli0 / moa-tli1 alternately)
  verify-raw         raw HTTP sessions: drafts made from the greedy continuation with wrong tokens
                     and wrong branches; checks every verdict; replays a request (idempotency) and
                     rewinds to an earlier position now and then; closes its session
  generate           POST /v1/generate, whole answer
  generate-stream    POST /v1/generate, streamed NDJSON (raw, or the API-baseline client)
  stream-disconnect  streams, then hangs up after a few tokens; or gives up on a plain generate
                     before its answer (a deliberately short read timeout)
  abandon            opens a session, verifies a few rounds (one of them sometimes abandoned
                     mid-request), then leaves without closing it (the idle TTL frees it)

plus one prober on GET /v1/health. Every greedy output a client completes (whole generations, and
the verified prefix of a stream it hung up on or a session it abandoned) must equal plain greedy
decoding of the demo target (vllm_moa.decoding.chain.plain_greedy_generate, computed once per
prompt); every answer must be 2xx or a refusal (429, or 503 with Retry-After and an error message):
no other 5xx, no transport error on a request the client did not abort itself, no error line in a
stream, no traceback in the server's log. After the load, once the idle TTL has freed the
abandoned sessions, a leak check opens `max_sessions` sessions whose prompts add up to exactly the
token budget: it succeeds only if no session, generation or token was leaked by the load.
Recorded: status codes per route, latency percentiles per route (2xx), refusals, the server's RSS
over time (psutil, else /proc), completions per client kind.

    python benchmarks/server_load.py [--duration 60] [--clients 24] [--out benchmarks/results/server_load_cpu.json]

Writes the JSON (with provenance) and a PNG next to it; exits non-zero if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import ROOT, provenance  # noqa: E402

KINDS = ("draft-chain", "draft-tree", "verify-raw", "generate", "generate-stream", "stream-disconnect", "abandon")
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
        self.local = threading.local()  # .deliberate: the next request may be aborted by its client

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
                                                  or "error" not in _json(response)):
                self.fail(f"{route}: 503 without Retry-After or error message: {response.text[:200]}")
            elif status >= 400 and status not in REFUSALS:
                self.fail(f"{route}: unexpected refusal {status} {'' if stream else response.text[:300]}")
            return response

        http.send = recorded
        return http

    def _add(self, t0: float, route: str, status: int | None, error: str | None, deliberate: bool) -> None:
        now = time.perf_counter()
        with self.lock:
            self.rows.append((round(t0 - self.started, 4), route, status, now - t0, error, deliberate))


def _json(response) -> dict:
    try:
        data = response.json()
        return data if isinstance(data, dict) else {}
    except ValueError:
        return {}


def rss_bytes(pid: int) -> int | None:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
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
        self.samples: list[tuple[float, float]] = []  # (seconds since start, MiB)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            rss = rss_bytes(self.pid)
            if rss is not None:
                self.samples.append((round(time.perf_counter() - self.started, 2), round(rss / 2**20, 2)))
            self.stop.wait(self.period)

    def latest(self) -> float | None:
        return self.samples[-1][1] if self.samples else None


# -- the server ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(port: int, tokens: list[str], limits: dict, log_path: Path) -> subprocess.Popen:
    """`vllm-moa serve` (demo target + moa-tli0/moa-tli1) on 127.0.0.1:port, 1 torch thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_MOA_TOKEN": ",".join(tokens)}
    command = [sys.executable, "-m", "vllm_moa.cli", "serve", "--port", str(port), "--threads", "1",
               "--log-level", "warning"]
    for key, value in limits.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    with log_path.open("w") as log:
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def wait_ready(proc: subprocess.Popen, port: int, log_path: Path) -> None:
    import httpx

    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> int | None:
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=30)


# -- clients ------------------------------------------------------------------------------------------
class Context:
    """What every client thread shares."""

    def __init__(self, args, url, target, drafters, prompts, reference, recorder, deadline) -> None:
        self.args, self.url, self.target, self.drafters = args, url, target, drafters
        self.prompts, self.reference, self.rec, self.deadline = prompts, reference, recorder, deadline
        from vllm_moa.serving.local import open_local

        self.decls = {name: open_local(d, target).declaration().model_dump(mode="json")
                      for name, d in drafters.items()}
        self.decls["ngram"] = {"kind": "ngram"}
        self.stop = threading.Event()  # set on a hard stop (grace period over)

    def http(self, token: str, timeout=TIMEOUT_S):
        import httpx

        return self.rec.wrap(httpx.Client(base_url=self.url, timeout=timeout,
                                          headers={"authorization": f"Bearer {token}"}))

    def work(self, rng: random.Random) -> tuple[int, list[int], int]:
        """A prompt index, its ids, and a number of new tokens."""
        p = rng.randrange(len(self.prompts))
        return p, self.prompts[p], rng.randint(self.args.min_new_tokens, self.args.max_new_tokens)

    def expected(self, p: int, n: int) -> list[int]:
        return self.reference[p][:n]

    def running(self) -> bool:
        return time.monotonic() < self.deadline and not self.stop.is_set()

    def check(self, kind: str, what: str, got: list[int], want: list[int], seconds: float | None = None) -> bool:
        if got == want:
            self.rec.outcome(kind, "exact", seconds)
            return True
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        self.rec.outcome(kind, "mismatch")
        self.rec.fail(f"{kind}: {what} differs from greedy decoding at token {first} "
                      f"({len(got)} tokens, expected {len(want)}; got {got[first:first + 4]}, "
                      f"want {want[first:first + 4]})")
        return False

    def refused(self, kind: str, status: int, rng: random.Random) -> None:
        self.rec.outcome(kind, f"refused-{status}")
        time.sleep(rng.uniform(0.1, 0.6))


def _drafting_client(ctx: Context, kind: str, index: int, token: str, rng: random.Random) -> None:
    from vllm_moa.serving.client import RemoteDraftingClient, RequestRefused, ServerUnavailable

    while ctx.running():
        p, prompt, n = ctx.work(rng)
        if kind == "draft-chain":
            name, width = "moa-tli0", None
        else:
            name, width = ("moa-tli0", "moa-tli1")[(index // len(KINDS)) % 2], 4
        num_draft = rng.choice([None, 2, 4, 6])
        encoding = rng.choice(["fp16", "fp16", "int8"])
        # a new client (and connection) now and then: /v1/info and connection churn
        client = RemoteDraftingClient(ctx.url, ctx.drafters[name], ctx.target, token=token, encoding=encoding,
                                      num_draft=num_draft, tree_top_k=width, timeout=TIMEOUT_S, backoff_s=0.05,
                                      backoff_max_s=1.0, give_up_after_s=ctx.args.give_up_after, seed=rng.randrange(2**31))
        ctx.rec.wrap(client.transport.http)
        t0 = time.perf_counter()
        try:
            with client:
                result = client.generate(prompt, n)
        except RequestRefused as err:
            if err.status in REFUSALS:
                ctx.refused(kind, err.status, rng)
                continue
            ctx.rec.fail(f"{kind}: refused {err.status}: {err.message}")
            continue
        except ServerUnavailable as err:
            ctx.rec.outcome(kind, "gave-up")
            ctx.rec.fail(f"{kind}: gave up: {err}")
            continue
        if result.num_verified != len(result.token_ids):
            ctx.rec.fail(f"{kind}: only {result.num_verified} of {len(result.token_ids)} tokens verified "
                         f"({result.finish_reason})")
        ctx.check(kind, f"{name} {'tree' if width else 'chain'} output", result.token_ids, ctx.expected(p, n),
                  time.perf_counter() - t0)


def _tree(rng: random.Random, root: int, right: list[int], vocab: int, max_nodes: int) -> tuple[dict, int]:
    """A draft tree rooted at `root`: a few wrong first tokens as siblings, then a chain whose first
    `j` tokens are `right` (the greedy continuation) and whose next ones are wrong. Returns the tree
    and j: greedy verification must accept exactly right[:j]."""
    def wrong(than: int) -> int:
        token = rng.randrange(vocab)
        return token if token != than else (token + 1) % vocab

    tokens, parents = [root], [-1]
    for _ in range(rng.choice([0, 0, 1, 2])):  # wrong branches (a wrong token, maybe a child under it)
        tokens.append(wrong(right[0]))
        parents.append(0)
        if rng.random() < 0.5:
            tokens.append(right[1])  # right token under a wrong parent: must not be accepted
            parents.append(len(tokens) - 2)
    depth = rng.randint(1, min(8, max_nodes - len(tokens)))
    j = rng.randint(0, depth)
    parent = 0
    for d in range(depth):
        tokens.append(right[d] if d < j else wrong(right[d]))
        parents.append(parent)
        parent = len(tokens) - 1
    return {"tokens": tokens, "parents": parents}, j


def _session_rounds(ctx: Context, kind: str, http, rng: random.Random, p: int, prompt: list[int], n: int,
                    rounds: int | None) -> tuple[str | None, list[int]] | None:
    """Open a session and verify rounds of drafts made from the greedy continuation (checking every
    verdict) until `n` tokens (rounds None) or `rounds` rounds. Returns (session id, verified
    tokens), or None if refused / failed."""
    ref = ctx.reference[p]
    decl = rng.choice(["ngram", "moa-tli0", "moa-tli1"])
    r = http.post("/v1/sessions", json={"prompt": prompt, "drafter": ctx.decls[decl],
                                        "encoding": rng.choice(["fp16", "int8"])})
    if r.status_code in REFUSALS:
        ctx.refused(kind, r.status_code, rng)
        return None
    if r.status_code != 200:
        return None  # recorded by the recorder
    opened = r.json()
    sid, seq = opened["session_id"], opened["length"]
    if seq != len(prompt) or opened["first_token"] != ref[0]:
        ctx.check(kind, "first token", [opened["first_token"]], ref[:1])
        return sid, []
    out = [opened["first_token"]]  # out[-1]: the pending token; prompt + out[:-1] have been run
    done = 0
    while (len(out) < n) if rounds is None else (done < rounds):
        m = len(out) - 1  # index in `out` of the draft's root
        if m > 0 and rng.random() < 0.1:  # rewind: verify again from an earlier position
            m = rng.randrange(0, m)
        root_seq = len(prompt) + m
        tree, j = _tree(rng, out[m], ref[m + 1:], ctx.target.vocab_size, 16)
        body = {"seq": root_seq, "tree": tree}
        deliberate = kind == "abandon" and rng.random() < 0.3
        if deliberate:  # the client hangs up before the answer comes; the session is abandoned
            import httpx

            ctx.rec.local.deliberate = True
            try:
                http.post(f"/v1/sessions/{sid}/verify", json=body, timeout=httpx.Timeout(5.0, read=0.002))
            except httpx.TimeoutException:
                ctx.rec.outcome(kind, "aborted-verify")
                return sid, out
            finally:
                ctx.rec.local.deliberate = False
        for attempt in range(2 if rng.random() < 0.1 else 1):  # now and then the same request twice
            while True:
                r = http.post(f"/v1/sessions/{sid}/verify", json=body)
                if r.status_code != 503 or ctx.stop.is_set():
                    break
                ctx.refused(kind, r.status_code, rng)  # over the token budget: retry (idempotent)
            if r.status_code != 200:
                return sid, out  # a refusal, or recorded as a failure by the recorder
            verdict = r.json()
            if attempt == 1 and not verdict.get("replayed"):
                ctx.rec.fail(f"{kind}: the same verify request twice was not replayed")
        got = verdict["accepted"] + [verdict["next_token"]]
        want = ref[m + 1 : m + 1 + j] + [ref[m + 1 + j]]
        if got != want or verdict["seq"] != root_seq + j + 1:
            ctx.check(kind, f"verdict (seq {root_seq}, {len(tree['tokens'])} nodes)", got, want)
            return sid, []
        out = out[: m + 1] + got
        done += 1
    return sid, out


def _raw_session_client(ctx: Context, kind: str, index: int, token: str, rng: random.Random) -> None:
    http = ctx.http(token)
    with http:
        while ctx.running():
            p, prompt, n = ctx.work(rng)
            t0 = time.perf_counter()
            rounds = None if kind == "verify-raw" else rng.randint(0, 3)
            got = _session_rounds(ctx, kind, http, rng, p, prompt, n, rounds)
            if got is None:
                continue
            sid, out = got
            if not out:
                continue  # a mismatch, recorded
            if kind == "verify-raw":
                ctx.check(kind, "session output", out[:n], ctx.expected(p, n), time.perf_counter() - t0)
                r = http.delete(f"/v1/sessions/{sid}")
                if r.status_code != 200:
                    ctx.rec.fail(f"{kind}: close answered {r.status_code}")
            else:  # abandon: leave it open; what was verified must still be greedy
                ctx.check(kind, "abandoned session's prefix", out, ctx.reference[p][: len(out)],
                          time.perf_counter() - t0)
                time.sleep(rng.uniform(0.0, 0.5))


def _generate_client(ctx: Context, kind: str, index: int, token: str, rng: random.Random) -> None:
    import httpx

    from vllm_moa.serving.client import RemoteDraftingClient, RequestRefused, ServerUnavailable

    http = ctx.http(token)
    with http:
        while ctx.running():
            p, prompt, n = ctx.work(rng)
            want = ctx.expected(p, n)
            body = {"prompt": prompt, "max_tokens": n}
            t0 = time.perf_counter()
            if kind == "generate":
                r = http.post("/v1/generate", json=body)
                if r.status_code in REFUSALS:
                    ctx.refused(kind, r.status_code, rng)
                elif r.status_code == 200:
                    ctx.check(kind, "generate output", r.json()["tokens"], want, time.perf_counter() - t0)
                continue
            if kind == "generate-stream" and rng.random() < 0.3:  # the API-baseline client
                client = RemoteDraftingClient(ctx.url, None, token=token, timeout=TIMEOUT_S,
                                              give_up_after_s=ctx.args.give_up_after)
                ctx.rec.wrap(client.transport.http)
                try:
                    with client:
                        result = client.generate(prompt, n)
                except RequestRefused as err:
                    if err.status in REFUSALS:
                        ctx.refused(kind, err.status, rng)
                    else:
                        ctx.rec.fail(f"{kind}: refused {err.status}: {err.message}")
                    continue
                except ServerUnavailable as err:
                    ctx.rec.fail(f"{kind}: gave up: {err}")
                    continue
                ctx.check(kind, "API client output", result.token_ids, want, time.perf_counter() - t0)
                continue
            if kind == "stream-disconnect" and rng.random() < 0.3:  # give up before the answer
                ctx.rec.local.deliberate = True
                try:
                    r = http.post("/v1/generate", json=body, timeout=httpx.Timeout(5.0, read=0.002))
                    if r.status_code in REFUSALS:
                        ctx.refused(kind, r.status_code, rng)
                    elif r.status_code == 200:  # it was faster than the timeout
                        ctx.check(kind, "generate output", r.json()["tokens"], want, time.perf_counter() - t0)
                except httpx.TimeoutException:
                    ctx.rec.outcome(kind, "aborted-generate")
                finally:
                    ctx.rec.local.deliberate = False
                continue
            hang_up = rng.randint(1, max(1, n - 1)) if kind == "stream-disconnect" else None
            tokens, lines = [], []
            with http.stream("POST", "/v1/generate", json={**body, "stream": True}) as r:
                if r.status_code in REFUSALS:
                    r.read()
                    if r.status_code == 503 and ("retry-after" not in r.headers or "error" not in _json(r)):
                        ctx.rec.fail(f"{kind}: 503 without Retry-After or error message")
                    ctx.refused(kind, r.status_code, rng)
                    continue
                if r.status_code != 200:
                    continue  # recorded
                try:
                    for line in r.iter_lines():
                        if not line.strip():
                            continue
                        data = json.loads(line)
                        lines.append(data)
                        if "error" in data:
                            ctx.rec.fail(f"{kind}: error line in the stream: {data}")
                            break
                        tokens += data.get("tokens", [])
                        if hang_up is not None and len(tokens) >= hang_up:
                            break  # hang up mid-stream (closing the response closes the connection)
                except httpx.HTTPError as err:
                    ctx.rec.fail(f"{kind}: stream broke: {type(err).__name__}: {err}")
                    continue
            if hang_up is not None:
                ctx.rec.outcome(kind, "hung-up-mid-stream" if len(tokens) < n else "stream-ended-first")
                ctx.check(kind, "streamed prefix before hanging up", tokens, want[: len(tokens)],
                          time.perf_counter() - t0)
            else:
                if not lines or not lines[-1].get("done") or lines[-1].get("finish_reason") != "length":
                    ctx.rec.fail(f"{kind}: the stream did not end with a done line: {lines[-1:]}")
                ctx.check(kind, "streamed output", tokens, want, time.perf_counter() - t0)


def client_thread(ctx: Context, kind: str, index: int, token: str) -> None:
    rng = random.Random(ctx.args.seed * 1000 + index)
    runner = {"draft-chain": _drafting_client, "draft-tree": _drafting_client, "verify-raw": _raw_session_client,
              "abandon": _raw_session_client}.get(kind, _generate_client)
    try:
        runner(ctx, kind, index, token, rng)
    except Exception as err:  # noqa: BLE001 - a client bug or an unusable answer: a failure
        import traceback

        ctx.rec.fail(f"{kind} client {index} crashed: {type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}")


def health_prober(ctx: Context, period: float = 0.25) -> None:
    import httpx

    http = ctx.rec.wrap(httpx.Client(base_url=ctx.url, timeout=TIMEOUT_S))
    with http:
        while ctx.running():
            try:
                r = http.get("/v1/health")
                if r.status_code != 200 or r.json().get("status") != "ok":
                    ctx.rec.fail(f"health answered {r.status_code}: {r.text[:200]}")
            except httpx.HTTPError:
                pass  # recorded
            time.sleep(period)


# -- after the load: nothing leaked ---------------------------------------------------------------------
def leak_check(ctx: Context, tokens: list[str], limits: dict) -> dict:
    """Open `max_sessions` sessions (one per client token) whose prompts add up to exactly the token
    budget: each open succeeds only if nothing (session, generation slot, token) is still held.
    Then the server must refuse one more session (503) and a generation (503, budget), and close all."""
    import httpx

    sessions, budget = limits["max_sessions"], limits["max_total_tokens"]
    lengths = [budget // sessions] * sessions
    lengths[-1] += budget - sum(lengths)
    stream = [t for p in ctx.prompts for t in p] * (1 + max(lengths) // max(1, sum(map(len, ctx.prompts))))
    report = {"sessions": sessions, "tokens": budget, "opened": 0, "refused_when_full": [], "ok": False}
    opened = []
    try:
        for i, length in enumerate(lengths):
            http = ctx.http(tokens[i])
            r = http.post("/v1/sessions", json={"prompt": stream[:length], "drafter": {"kind": "ngram"}})
            if r.status_code != 200:
                http.close()
                report["error"] = f"session {i} ({length} tokens) answered {r.status_code}: {r.text[:300]}"
                return report
            opened.append((http, r.json()["session_id"]))
        report["opened"] = len(opened)
        extra = ctx.http(tokens[sessions])
        with extra:
            r1 = extra.post("/v1/sessions", json={"prompt": stream[:4], "drafter": {"kind": "ngram"}})
            r2 = extra.post("/v1/generate", json={"prompt": stream[:4], "max_tokens": 4})
        report["refused_when_full"] = [r1.status_code, r2.status_code]
        if [r1.status_code, r2.status_code] != [503, 503]:
            report["error"] = f"a full server answered {r1.status_code} / {r2.status_code}, not 503 / 503"
            return report
        report["ok"] = True
        return report
    except httpx.HTTPError as err:
        report["error"] = f"{type(err).__name__}: {err}"
        return report
    finally:
        for http, sid in opened:
            try:
                if http.delete(f"/v1/sessions/{sid}").status_code != 200:
                    report["ok"] = False
            except httpx.HTTPError:
                report["ok"] = False
            http.close()


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


def summarize(rec: Recorder, load_s: tuple[float, float]) -> dict:
    """load_s: the load phase (start, end), seconds since the server was launched."""
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
    return {
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
    fig.suptitle(f"vllm-moa server under load: {cfg['clients']} clients for {cfg['duration_s']:.0f} s on the demo "
                 f"models (CPU, loopback); {s['requests']} requests, "
                 f"{s['server_errors_5xx_other_than_503']} 5xx (other than 503), "
                 f"{s['refusals']['429']} x 429, {s['refusals']['503']} x 503")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=24, help="concurrent client threads (+ 1 health prober)")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts (each's greedy output computed once)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (last tokens of each prompt)")
    parser.add_argument("--min-new-tokens", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-sessions", type=int, default=None, help="server limit (default: clients / 2)")
    parser.add_argument("--max-generations", type=int, default=None, help="server limit (default: clients / 6)")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="server token budget (default: 3/4 of what max sessions + generations could hold)")
    parser.add_argument("--session-ttl", type=float, default=8.0, help="server idle TTL (frees abandoned sessions)")
    parser.add_argument("--give-up-after", type=float, default=90.0, help="drafting clients' give_up_after_s")
    parser.add_argument("--grace", type=float, default=180.0, help="seconds after the load for clients to finish")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "server_load_cpu.json")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.duration <= 0:
        parser.error("--clients must be >= 1 and --duration > 0")
    if not 1 <= args.min_new_tokens <= args.max_new_tokens:
        parser.error("need 1 <= --min-new-tokens <= --max-new-tokens")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the load test; returns the result (also written to --out). Raises LoadTestFailed after
    writing the results if any check failed."""
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from vllm_moa.decoding.chain import plain_greedy_generate
    from vllm_moa.models import load_drafter
    from vllm_moa.shipped import SHIPPED
    from vllm_moa.target import TargetModel

    torch.set_num_threads(1)
    wall0 = time.perf_counter()
    target = TargetModel.from_pretrained(SHIPPED / "target")
    target.name = json.loads((SHIPPED / "moa-tli0" / "config.json").read_text())["target"]["name"]
    drafters = {name: load_drafter(SHIPPED / name, target).eval() for name in ("moa-tli0", "moa-tli1")}
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED / "target"))
    texts = [p["text"] for p in json.loads((SHIPPED / "heldout_prompts.json").read_text())][: args.prompts]
    prompts = [tokenizer(t)["input_ids"][-args.prompt_tokens:] for t in texts]
    # enough of each greedy continuation for every draft's verdict (depth <= 8 past max_new_tokens)
    reference = [plain_greedy_generate(target, p, args.max_new_tokens + 10).token_ids
                 for p in tqdm(prompts, desc="greedy references", disable=args.no_progress)]

    c = args.clients
    limits = {
        "max_sessions": args.max_sessions or max(2, c // 2),
        "max_sessions_per_client": 2,
        "max_generations": args.max_generations or max(2, c // 6),
        "max_generations_per_client": 1,
        "max_draft_nodes": 32,
        "session_ttl": args.session_ttl,
    }
    per_sequence = args.prompt_tokens + args.max_new_tokens
    limits["max_total_tokens"] = args.max_total_tokens or max(
        limits["max_sessions"] * args.prompt_tokens,
        3 * (limits["max_sessions"] + limits["max_generations"]) * per_sequence // 4)
    if limits["max_total_tokens"] < limits["max_sessions"] * 8:
        raise ValueError("--max-total-tokens is too small for the leak check (8 tokens per session at least)")
    # one bearer token per client (per-client limits apply to each), per leak-check session, + 1
    tokens = [f"load-{i:04d}-{random.Random(i).getrandbits(64):016x}" for i in range(c + limits["max_sessions"] + 1)]
    kinds = [KINDS[i % len(KINDS)] for i in range(c)]

    log_file = tempfile.NamedTemporaryFile("w", suffix=".log", prefix="server_load-", delete=False)
    log_path = Path(log_file.name)
    log_file.close()
    port = _free_port()
    started = time.perf_counter()
    server_limits = dict(limits)
    proc = launch_server(port, tokens, server_limits, log_path)
    sampler = MemorySampler(proc.pid, started)  # from the start: model loading included
    sampler.start()
    try:
        wait_ready(proc, port, log_path)
    except BaseException:
        sampler.stop.set()
        stop_server(proc)
        raise
    rec = Recorder(started)
    phases = {"server_ready": round(time.perf_counter() - started, 2)}
    load_start = time.perf_counter()
    phases["load_start"] = round(load_start - started, 2)
    ctx = Context(args, f"http://127.0.0.1:{port}", target, drafters, prompts, reference, rec,
                  time.monotonic() + args.duration)
    threads = [threading.Thread(target=client_thread, args=(ctx, kinds[i], i, tokens[i]), daemon=True,
                                name=f"client-{i}-{kinds[i]}") for i in range(c)]
    threads.append(threading.Thread(target=health_prober, args=(ctx,), daemon=True, name="health"))
    for t in threads:
        t.start()
    bar = tqdm(total=round(args.duration), desc=f"load ({c} clients)", unit="s", disable=args.no_progress)
    last_print = 0.0
    while time.monotonic() < ctx.deadline:
        time.sleep(1.0)
        elapsed = time.perf_counter() - load_start
        bar.n = min(round(args.duration), int(elapsed))
        with rec.lock:
            codes = Counter(r[2] for r in rec.rows)
            done = sum(rec.completed.values())
            failures = len(rec.failures)
        postfix = dict(req=sum(codes.values()), exact=done, r429=codes.get(429, 0), r503=codes.get(503, 0),
                       fail=failures, rss_mb=sampler.latest())
        bar.set_postfix(postfix)
        if args.no_progress and elapsed - last_print >= 10:
            print(f"[{elapsed:5.0f}s] {postfix}", flush=True)
            last_print = elapsed
    bar.close()
    phases["load_end"] = round(time.perf_counter() - started, 2)
    grace_end = time.monotonic() + args.grace
    for t in threads:
        t.join(timeout=max(0.0, grace_end - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        ctx.stop.set()
        rec.fail(f"clients still running {args.grace:.0f}s after the load ended: {stuck}")
    phases["drain_end"] = round(time.perf_counter() - started, 2)
    if proc.poll() is not None:
        rec.fail(f"the server exited during the load (code {proc.returncode})")
        leak = {"ok": False, "error": "server gone"}
    else:
        # the abandoned sessions expire after the idle TTL (any open reaps them)
        time.sleep(limits["session_ttl"] + 1.0)
        phases["leak_check_start"] = round(time.perf_counter() - started, 2)
        leak = leak_check(ctx, tokens[c:], limits)
        if not leak["ok"]:
            rec.fail(f"leak check: {leak.get('error', leak)}")
    phases["leak_check_end"] = round(time.perf_counter() - started, 2)
    time.sleep(1.0)
    sampler.stop.set()
    sampler.join(timeout=5)
    code = stop_server(proc)
    server_log = log_path.read_text(errors="replace")
    log_path.unlink(missing_ok=True)
    if "Traceback" in server_log or "ERROR" in server_log:
        rec.fail(f"the server logged errors:\n{server_log[-3000:]}")

    summary = summarize(rec, (phases["load_start"], phases["load_end"]))
    for kind in sorted(set(kinds)):
        if summary["completed_exact_by_kind"].get(kind, 0) == 0:
            rec.fail(f"no {kind} client completed a checked generation")
    if summary["server_errors_5xx_other_than_503"]:
        rec.fail(f"{summary['server_errors_5xx_other_than_503']} answers were 5xx (other than 503 refusals)")
    samples = sampler.samples
    start, end = phases["load_start"], phases["load_end"]
    mid = (start + end) / 2
    rss = {
        "at_server_ready": next((m for t, m in samples if t >= phases["server_ready"]), None),
        "peak_during_load": max((m for t, m in samples if start <= t <= end), default=None),
        "first_half_of_load_max": max((m for t, m in samples if start <= t < mid), default=None),
        "second_half_of_load_max": max((m for t, m in samples if mid <= t <= end), default=None),
        "after_leak_check": samples[-1][1] if samples else None,
        "source": "psutil" if _has_psutil() else "/proc/PID/status VmRSS",
        "samples": samples,
    }
    result = {
        "what": "bounded load test of the vllm-moa verification server (vllm-moa serve, demo target + MoA "
                "drafters) on 127.0.0.1: concurrent drafting sessions (chains, trees), raw verify calls, "
                "/v1/generate (streamed and not), disconnecting and abandoning clients, health probes",
        "passed": not rec.failures,
        "failures": rec.failures[:200],
        "summary": summary,
        "leak_check": leak,
        "rss_mb": rss,
        "phases_s": phases,
        "server_exit_code": code,
        "server_log": {"lines": len(server_log.splitlines()),
                       "warnings": sum("WARNING" in line for line in server_log.splitlines()),
                       "tail": server_log[-2000:]},
        "config": {
            "duration_s": args.duration, "clients": c, "client_kinds": dict(Counter(kinds)),
            "health_probe_period_s": 0.25, "prompts": len(prompts), "prompt_tokens": args.prompt_tokens,
            "new_tokens": [args.min_new_tokens, args.max_new_tokens], "greedy": True, "seed": args.seed,
            "server": "python -m vllm_moa.cli serve --threads 1 (OMP_NUM_THREADS=1), bearer token per client, "
                      "demo target + moa-tli0 + moa-tli1 (vllm_moa/assets/demo)",
            "server_limits": server_limits, "client_torch_threads": 1, "request_timeout_s": TIMEOUT_S,
            "latency": "client-side, from send to the response headers (streams) or the whole answer",
        },
        "request_timeline": [(r[0], r[2]) for r in rec.rows],
        "wall_seconds": round(time.perf_counter() - wall0, 1),
        "provenance": provenance(torch_threads=1, setup="server subprocess + client threads in one process, "
                                                        "loopback, both 1 torch thread"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    _print_report(result)
    if rec.failures:
        raise LoadTestFailed(f"{len(rec.failures)} failure(s); first: {rec.failures[0]}")
    return result


def _has_psutil() -> bool:
    try:
        import psutil  # noqa: F401

        return True
    except ImportError:
        return False


def _print_report(result: dict) -> None:
    s = result["summary"]
    print(f"\n{s['requests']} requests ({s['requests_per_s_during_load']}/s during the load); status: {s['status_counts']}")
    print(f"5xx other than 503: {s['server_errors_5xx_other_than_503']}; refusals 429: {s['refusals']['429']}, "
          f"503: {s['refusals']['503']}; deliberate client aborts: {s['deliberate_client_aborts']}")
    print(f"{'route':16} {'n':>6} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'max ms':>9}")
    for route, q in s["latency_ms_2xx"].items():
        print(f"{route:16} {q['n']:>6} {q['p50']:>9} {q['p90']:>9} {q['p99']:>9} {q['max']:>9}")
    print("exact greedy outputs by client kind:", s["completed_exact_by_kind"])
    r = result["rss_mb"]
    print(f"server RSS (MiB): ready {r['at_server_ready']}, peak under load {r['peak_during_load']} "
          f"(1st half {r['first_half_of_load_max']}, 2nd half {r['second_half_of_load_max']}), "
          f"after the leak check {r['after_leak_check']}")
    print(f"leak check: {result['leak_check']}")
    print("PASSED" if result["passed"] else f"FAILED: {len(result['failures'])} failure(s):\n  "
          + "\n  ".join(f[:500] for f in result["failures"][:10]))


if __name__ == "__main__":
    try:
        main()
    except LoadTestFailed as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
