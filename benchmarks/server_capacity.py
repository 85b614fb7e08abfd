"""Server capacity with clients that draft elsewhere (issue 65, item 2): how many tokens per second
one server gives N users of MoA clients, against N plain API streams, when the clients' drafting
does not run on the server's cores.

On this 2-core machine a real client drafts on the cores the server needs (client_server_users.py
charges it to the server's wall clock). Here every client is a replay (benchmarks/client_replay.py):
one real MoA client (the defaults: chains + lookup, draft depth adapted) generates each held-out
prompt once against the server and is recorded; then N users replay those recordings at once
(user i the recording of prompt i mod P), each on its own session, waiting the recorded drafting
time between an answer and its next request. Against them, N plain API streams (/v1/generate,
streamed, greedy) with the same prompts and lengths. Every API output is checked against the
target's greedy output (transformers; near-ties as in client_server_users), every replayed answer
against the recorded one, every recorded run against the target's greedy output.

For each N the two modes take turns for --passes passes (the order reversed every pass); per mode
the median pass. Per pass and mode:

    served_tokens_per_s   all users' tokens / the wall time from the first start to the last end
    tbt_p50_ms, p99       time between tokens as a user sees them (a delivery of k tokens t ms after
                          the previous one counts k gaps of t/k ms; time to first token left out)
    server_cpu_ms_per_token  CPU time of the server's processes per token served

The link is loopback (no netsim): the capacity figure, not a far user's latency (the latency grid,
benchmarks/client_server.py, measures that).

    python -m benchmarks.server_capacity [--backend vllm] [--users 1,4,16,64] [--tokens 64] [--passes 3]

Writes benchmarks/results/server_capacity_<backend>_smollm2.{json,png} (with provenance).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from benchmarks.client_replay import describe, record_run, replay_users
from benchmarks.client_server import ROOT, free_port, start_server
from benchmarks.client_server_users import near_tie_gap, plot_users, run_user_group, server_cpu_seconds
from benchmarks.provenance import provenance
from vllm_moa.chat import encode_prompt
from vllm_moa.decoding.chain import plain_greedy_generate
from vllm_moa.models import load_drafter
from vllm_moa.serving.client import RemoteDraftingClient
from vllm_moa.shipped import SHIPPED_SMOLLM2
from vllm_moa.target import TargetModel
from vllm_moa.targets import fetch_smollm2

MODES = ("moa-replay", "api")


def _record(url: str, target, drafter, prompts: list, expected: list, tokens: int) -> list:
    """One recorded MoA client run per prompt, each checked against the target's greedy output."""
    recordings = []
    with RemoteDraftingClient(url, drafter, target, timeout=120) as client:
        client.generate(prompts[0], 8)  # warm-up: the server's first rounds, the client's drafter
        for prompt, want in tqdm(list(zip(prompts, expected)), desc="recording clients"):
            recording = record_run(client, prompt, tokens)
            got = recording.token_ids
            if got != want[:tokens] and near_tie_gap(target, prompt, got, want[:tokens]) is None:
                raise AssertionError("a recorded client's output differs from the target's greedy output")
            recordings.append(recording)
    return recordings


def _measure(mode: str, url: str, server_pid: int, recordings: list, prompts: list, expected: list, count: int,
             tokens: int, target) -> dict:
    cpu = server_cpu_seconds(server_pid)
    if mode == "api":
        run = run_user_group(lambda: RemoteDraftingClient(url, None, target, timeout=300), prompts, expected, count,
                         tokens, target)
        run["diverged"], run["errors"] = [], []
    else:
        run = replay_users(url, recordings, count)
        if run["errors"]:
            raise AssertionError("; ".join(run["errors"]))
    cpu = server_cpu_seconds(server_pid) - cpu
    gaps = sorted(run.pop("gaps"))
    return {"mode": mode, "users": count, **run,
            "served_tokens_per_s": run["tokens"] / run["wall_s"],
            "tbt_p50_ms": 1e3 * statistics.median(gaps) if gaps else None,
            "tbt_p99_ms": 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None,
            "server_cpu_ms_per_token": 1e3 * cpu / run["tokens"]}


def summarize(rows: list[dict], users: list[int]) -> dict:
    """Per N: each mode's median pass (by tokens/s) and the ratio of the medians."""
    summary = {}
    for count in users:
        best = {}
        for mode in MODES:
            runs = sorted((r for r in rows if r["users"] == count and r["mode"] == mode),
                          key=lambda r: r["served_tokens_per_s"])
            best[mode] = runs[len(runs) // 2]
            best[mode + "_passes"] = [round(r["served_tokens_per_s"], 2) for r in
                                      sorted((r for r in rows if r["users"] == count and r["mode"] == mode),
                                             key=lambda r: r["pass"])]
        moa, api = best["moa-replay"], best["api"]
        summary[f"users={count}"] = {
            "served_tokens_per_s": round(moa["served_tokens_per_s"], 2),
            "api_tokens_per_s": round(api["served_tokens_per_s"], 2),
            "served_vs_api": round(moa["served_tokens_per_s"] / api["served_tokens_per_s"], 3),
            "served_tokens_per_s_passes": best["moa-replay_passes"], "api_tokens_per_s_passes": best["api_passes"],
            "tbt_p50_ms": round(moa["tbt_p50_ms"], 2), "api_tbt_p50_ms": round(api["tbt_p50_ms"], 2),
            "tbt_p99_ms": round(moa["tbt_p99_ms"], 2), "api_tbt_p99_ms": round(api["tbt_p99_ms"], 2),
            "server_cpu_ms_per_token": round(moa["server_cpu_ms_per_token"], 2),
            "api_server_cpu_ms_per_token": round(api["server_cpu_ms_per_token"], 2),
            "diverged_users": sum(len(r["diverged"]) for r in rows if r["users"] == count and r["mode"] == "moa-replay"),
        }
    return summary


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rate, ax_tbt) = plt.subplots(1, 2, figsize=(10, 4))
    plot_users(summary, ax_rate, ax_tbt, moa_label="MoA clients drafting elsewhere (replayed)",
               rate_title="tokens/s served, all users (dots: passes)")
    counts = [int(key.split("=")[1]) for key in summary]
    for line, passes in zip(ax_rate.get_lines(), ("served_tokens_per_s_passes", "api_tokens_per_s_passes")):
        for count, row in zip(counts, summary.values()):
            ax_rate.scatter([count] * len(row[passes]), row[passes], s=8, color=line.get_color(), alpha=0.5)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("vllm", "transformers"), default="vllm")
    parser.add_argument("--users", default="1,4,16,64")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts recorded (users reuse them)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or ROOT / "benchmarks" / "results" / f"server_capacity_{args.backend}_smollm2.json"
    users = [int(n) for n in args.users.split(",") if n.strip()]
    torch.set_num_threads(1)
    prov = provenance(torch_threads=1, setup="server subprocess (vllm-moa serve) <- replaying users and API "
                      "streams (threads of this process), 127.0.0.1, no netsim",
                      config={"backend": args.backend, "users": users, "prompts": args.prompts, "tokens": args.tokens,
                              "passes": args.passes, "client": "RemoteDraftingClient defaults (MoA moa-tli0 chains "
                              "+ lookup, adaptive depth)", "greedy": True})
    target_dir = fetch_smollm2()
    target = TargetModel.from_pretrained(target_dir)
    drafter = load_drafter(SHIPPED_SMOLLM2 / "moa-tli0", target).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    texts = [p if isinstance(p, str) else p["text"]
             for p in json.loads((SHIPPED_SMOLLM2 / "heldout_prompts.json").read_text())]
    prompts = [encode_prompt(tokenizer, t) for t in texts][: args.prompts]
    expected = [plain_greedy_generate(target, p, args.tokens).token_ids for p in prompts]
    (ROOT / "runs").mkdir(exist_ok=True)
    started = time.perf_counter()
    port = free_port()
    server = start_server(port, backend=args.backend, target=target_dir,
                          drafters={"moa-tli0": SHIPPED_SMOLLM2 / "moa-tli0"})
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        recordings = _record(url, target, drafter, prompts, expected, args.tokens)
        _measure("api", url, server.pid, recordings, prompts, expected, 4, 8, target)  # warm-up
        for count in tqdm(users, desc="users"):
            for number in range(args.passes):
                for mode in (MODES if number % 2 == 0 else MODES[::-1]):
                    row = _measure(mode, url, server.pid, recordings, prompts, expected, count, args.tokens, target)
                    rows.append({**row, "pass": number})
    finally:
        server.terminate()
        server.wait(timeout=60)
    summary = summarize(rows, users)
    result = {"summary": summary, "recorded_clients": describe(recordings), "rows": rows,
              "wall_seconds": round(time.perf_counter() - started, 1), "provenance": prov}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(summary, out.with_suffix(".png"), f"SmolLM2-135M-Instruct, {args.backend} backend, {args.tokens} tokens per "
         f"user: clients that draft elsewhere vs plain API streams")
    print(json.dumps({"summary": summary, "recorded_clients": result["recorded_clients"]}, indent=2))


if __name__ == "__main__":
    main()
