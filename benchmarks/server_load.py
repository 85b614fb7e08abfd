"""A bounded load test of the verification server on loopback (reliability).

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

    python -m benchmarks.server_load [--duration 60] [--clients 24] [--out benchmarks/results/server_load_cpu.json]

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
from collections import Counter
from pathlib import Path

from benchmarks.load_clients import Context, client_thread, health_prober  # noqa: E402
from benchmarks.load_recorder import (  # noqa: E402
    KINDS,
    TIMEOUT_S,
    LoadTestFailed,
    MemorySampler,
    Recorder,
    plot,
    summarize,
)
from benchmarks.provenance import ROOT, provenance  # noqa: E402

VLLM_ENGINE = {"max_model_len": 2048, "block_size": 32}  # --backend vllm (CPU_ATTN: blocks of 32k)


# -- the server ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(port: int, tokens: list[str], limits: dict, log_path: Path, backend: str = "transformers",
                  target: Path | None = None, drafters: dict[str, Path] | None = None,
                  preload: str | None = None) -> subprocess.Popen:
    """`vllm-moa serve` (demo target + moa-tli0/moa-tli1, or `target` + `drafters`) on
    127.0.0.1:port, 1 torch thread; with backend "vllm", the target in vLLM's engine."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_MOA_TOKEN": ",".join(tokens)}
    if preload:  # e.g. tcmalloc, as vLLM's CPU docs advise (glibc's malloc fragments its worker's heap)
        env["LD_PRELOAD"] = preload
    command = [sys.executable, "-m", "vllm_moa.cli", "serve", "--port", str(port), "--threads", "1",
               "--log-level", "warning"]
    if target is not None:
        command += ["--target", str(target)]
    for name, path in (drafters or {}).items():
        command += ["--drafter", f"{name}={path}"]
    if backend == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        command += ["--backend", "vllm", "--vllm-engine-args", json.dumps(VLLM_ENGINE)]
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
    parser.add_argument("--backend", choices=("transformers", "vllm"), default="transformers",
                        help="the server's target backend (vllm: `vllm-moa serve --backend vllm`, needs vLLM)")
    parser.add_argument("--target", choices=("demo", "smollm2"), default="demo",
                        help="smollm2: SmolLM2-135M-Instruct (vllm-moa fetch smollm2) and its shipped MoA drafter, "
                             "on its held-out chat prompts")
    parser.add_argument("--max-new-tokens-limit", type=int, default=1024, help="the server's max_new_tokens")
    parser.add_argument("--disconnect-clients", type=int, default=0,
                        help="stream-disconnect clients beyond the round robin (more mid-stream hang-ups)")
    parser.add_argument("--server-preload", default=None,
                        help="LD_PRELOAD for the server, e.g. /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/results/server_load_cpu.json (_<backend>_<target> otherwise)")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.duration <= 0:
        parser.error("--clients must be >= 1 and --duration > 0")
    if not 1 <= args.min_new_tokens <= args.max_new_tokens:
        parser.error("need 1 <= --min-new-tokens <= --max-new-tokens")
    if args.server_preload and not Path(args.server_preload).is_file():
        parser.error(f"--server-preload {args.server_preload}: no such file (Debian: apt-get install "
                     "libtcmalloc-minimal4)")
    return args


def errors_in_log(log: str, context: int = 3, limit: int = 6000) -> str:
    """The log's ERROR and Traceback lines with `context` lines after each (a traceback's body),
    at most `limit` characters; empty when there are none."""
    lines = log.splitlines()
    keep = sorted({j for i, line in enumerate(lines) if "ERROR" in line or "Traceback" in line
                   for j in range(i, min(len(lines), i + 1 + (40 if "Traceback" in line else context)))})
    return "\n".join(lines[j] for j in keep)[:limit]


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
    if args.out is None:
        name = "server_load_cpu" if (args.backend, args.target) == ("transformers", "demo") else \
            f"server_load_cpu_{args.backend}_{args.target}"
        args.out = ROOT / "benchmarks" / "results" / f"{name}.json"
    target_dir, served = None, None
    if args.target == "smollm2":
        from vllm_moa.chat import encode_prompt
        from vllm_moa.shipped import SHIPPED_SMOLLM2
        from vllm_moa.targets import fetch_smollm2

        target_dir = fetch_smollm2()
        target = TargetModel.from_pretrained(target_dir)
        served = {"moa-tli0": SHIPPED_SMOLLM2 / "moa-tli0"}
        drafters = {name: load_drafter(path, target).eval() for name, path in served.items()}
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        texts = [p if isinstance(p, str) else p["text"]
                 for p in json.loads((SHIPPED_SMOLLM2 / "heldout_prompts.json").read_text())][: args.prompts]
        prompts = [encode_prompt(tokenizer, t)[-args.prompt_tokens:] for t in texts]
    else:
        target = TargetModel.from_pretrained(SHIPPED / "target")
        target.name = json.loads((SHIPPED / "moa-tli0" / "config.json").read_text())["target"]["name"]
        drafters = {name: load_drafter(SHIPPED / name, target).eval() for name in ("moa-tli0", "moa-tli1")}
        tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED / "target"))
        texts = [p["text"] for p in json.loads((SHIPPED / "heldout_prompts.json").read_text())][: args.prompts]
        prompts = [tokenizer(t)["input_ids"][-args.prompt_tokens:] for t in texts]
    # enough of each greedy continuation for every draft's verdict (depth <= 8 past max_new_tokens)
    reference = [plain_greedy_generate(target, p, args.max_new_tokens + 10).token_ids
                 for p in tqdm(prompts, desc="greedy references", disable=args.no_progress)]

    kinds = [KINDS[i % len(KINDS)] for i in range(args.clients)] + ["stream-disconnect"] * args.disconnect_clients
    c = len(kinds)
    limits = {
        "max_sessions": args.max_sessions or max(2, c // 2),
        "max_sessions_per_client": 2,
        "max_generations": args.max_generations or max(2, c // 6),
        "max_generations_per_client": 1,
        "max_draft_nodes": 32,
        "max_new_tokens": args.max_new_tokens_limit,
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

    log_file = tempfile.NamedTemporaryFile("w", suffix=".log", prefix="server_load-", delete=False)
    log_path = Path(log_file.name)
    log_file.close()
    port = _free_port()
    started = time.perf_counter()
    server_limits = dict(limits)
    args.limits = limits  # the hostile clients read max_new_tokens
    proc = launch_server(port, tokens, server_limits, log_path, args.backend, target_dir, served, args.server_preload)
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
    error_lines = errors_in_log(server_log)
    if error_lines:
        rec.fail(f"the server logged errors:\n{error_lines}")

    summary = summarize(rec, (phases["load_start"], phases["load_end"]), until=phases["drain_end"])
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
        # warm-up: the first tenth of the load; the end: its last sample
        "after_warmup": next((m for t, m in samples if t >= start + (end - start) / 10), None),
        "at_load_end": next((m for t, m in reversed(samples) if t <= end), None),
        "process_tree": "the server process and every process under it (the vLLM backend's engine core and worker)",
        "source": "psutil" if _has_psutil() else "/proc/PID/status VmRSS",
        "samples": samples,
    }
    if rss["after_warmup"] and rss["at_load_end"]:
        rss["growth_from_warmup_to_load_end"] = round(rss["at_load_end"] / rss["after_warmup"] - 1, 4)
    own = sampler.own_samples
    rss["server_process_only"] = {
        "after_warmup": next((m for t, m in own if t >= start + (end - start) / 10), None),
        "at_load_end": next((m for t, m in reversed(own) if t <= end), None),
        "samples": own[::10]}
    result = {
        "what": f"bounded load test of the vllm-moa verification server (vllm-moa serve, backend {args.backend}, "
                f"{args.target} target + MoA drafters) on 127.0.0.1: concurrent drafting sessions (chains, trees), "
                "raw verify calls, /v1/generate (streamed and not), disconnecting and abandoning clients, hostile "
                "requests, health probes",
        "passed": not rec.failures,
        "failures": rec.failures[:200],
        "summary": summary,
        "leak_check": leak,
        "rss_mb": rss,
        "phases_s": phases,
        "server_exit_code": code,
        "server_log": {"lines": len(server_log.splitlines()),
                       "warnings": sum("WARNING" in line for line in server_log.splitlines()),
                       "errors": error_lines, "tail": server_log[-2000:]},
        "config": {
            "duration_s": args.duration, "clients": c, "client_kinds": dict(Counter(kinds)),
            "backend": args.backend, "target": args.target, "server_preload": args.server_preload,
            "vllm_engine": VLLM_ENGINE if args.backend == "vllm" else None,
            "health_probe_period_s": 0.25, "prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
            "new_tokens": [args.min_new_tokens, args.max_new_tokens], "greedy": True, "seed": args.seed,
            "server": "python -m vllm_moa.cli serve --threads 1 (OMP_NUM_THREADS=1), bearer token per client, "
                      f"{target_dir or SHIPPED / 'target'} + {' + '.join(drafters)}",
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
