"""More users per server (issue 53, item 5): N clients drafting against one server, against N plain
API streams on the same server, through the same netsim link (RTT and bandwidth of the grid).

For N in 1, 4, 16: N users start together, each on its own held-out prompt, each generating
`tokens` tokens; first as MoA clients (chains + lookup: the client's default), then as plain
API streams (/v1/generate). Every output is checked against the target's greedy output: where
it parts from it, the target's float32 logits (transformers) at that position must hold a near-tie
(the token the server chose within NEAR_TIE of the top logit: vLLM's kernels and transformers'
round differently), reported per mode (`near_ties`: user, position, gap); anything else fails.

    served_tokens_per_s   all users' tokens / the wall time from the first start to the last end
    served_vs_api         that of the clients over that of the N API streams
    tbt_p50_ms, p99       time between tokens as a user sees them: a delivery of k verified tokens
                          t ms after the previous one counts k gaps of t/k ms (a stream: one
                          token per delivery); the first token (time to first token) is left out
    server_cpu_ms_per_token  CPU time of the server's processes (vLLM's engine core included) per
                          token served: what each user costs the server

This machine has 2 cores for everything: the N clients' drafters (threads of this process), the
netsim proxy and the server. So the wall-clock numbers charge the clients' drafting to the same
cores the server needs; the server's CPU per token is the capacity figure when the clients draft
on their own devices, as the deployment intends.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import psutil

from vllm_moa.serving.client import RemoteDraftingClient
from vllm_moa.serving.netsim import LinkConditions

USERS = (1, 4, 16)
NEAR_TIE = 1e-4  # logit gap under which two float32 implementations may pick either token


def near_tie_gap(target, prompt: list[int], got: list[int], want: list[int]) -> tuple[int, float] | None:
    """(position, logit gap) where `got` first parts from `want`, if the target's logits there put
    the chosen token within NEAR_TIE of the top one; None when they are equal or it is no near-tie."""
    import torch

    position = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if position is None:
        return None
    with torch.no_grad():
        logits = target.hf_model(torch.tensor([prompt + want[:position]])).logits[0, -1].float()
    gap = float(logits.max() - logits[got[position]])
    return (position, gap) if gap < NEAR_TIE else None


def server_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the server process and its children (vLLM's engine core)."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def run_user_group(make_client: Callable, prompts: list, expected: list, count: int, tokens: int, target) -> dict:
    """`count` users at once; their tokens, wall, the gaps between deliveries and near-ties."""
    gaps: list[float] = []
    errors: list[str] = []
    outputs: dict[int, list[int]] = {}
    lock = threading.Lock()
    barrier = threading.Barrier(count)

    def user(i: int) -> None:
        prompt = prompts[i % len(prompts)]
        mine: list[float] = []
        last = [None]

        def on_event(event) -> None:
            if event.kind != "verified" or not event.tokens:
                return
            now = time.perf_counter()
            if last[0] is not None:
                mine.extend([(now - last[0]) / len(event.tokens)] * len(event.tokens))
            last[0] = now

        with make_client() as client:
            barrier.wait()
            result = client.generate(prompt, tokens, on_event=on_event)
        with lock:
            outputs[i] = result.token_ids
            gaps.extend(mine)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(count)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    near_ties = []
    for i, got in sorted(outputs.items()):
        prompt, want = prompts[i % len(prompts)], expected[i % len(prompts)][:tokens]
        if got == want:
            continue
        tie = near_tie_gap(target, prompt, got, want)
        if tie is None:
            errors.append(f"user {i}: output differs from the target's greedy output")
        else:
            near_ties.append({"user": i, "position": tie[0], "gap": tie[1]})
    if errors:
        raise AssertionError("; ".join(errors))
    return {"tokens": count * tokens, "wall_s": wall, "gaps": gaps, "near_ties": near_ties}


def run_users(sim, server_pid: int, target, drafter, prompts: list, expected: list, tokens: int, rtt_ms: float,
              bandwidth_mbit: float = 100.0, users=USERS) -> tuple[dict, list[dict]]:
    """The `clients=N` summary entries and the rows behind them."""
    sim.set_conditions(LinkConditions(rtt_ms=rtt_ms, bandwidth_mbit=bandwidth_mbit))
    modes = {"moa-chain+lookup": lambda: RemoteDraftingClient(sim.url, drafter, target, encoding="fp16",
                                                              tree_top_k=None, timeout=120, lookup=True),
             "api": lambda: RemoteDraftingClient(sim.url, None, target, timeout=120)}
    rows, summary = [], {}
    for count in users:
        measured = {}
        for mode, make_client in modes.items():
            cpu = server_cpu_seconds(server_pid)
            run = run_user_group(make_client, prompts, expected, count, tokens, target)
            cpu = server_cpu_seconds(server_pid) - cpu
            gaps = sorted(run.pop("gaps"))
            row = {"mode": mode, "clients": count, "rtt_ms": rtt_ms, "bandwidth_mbit": bandwidth_mbit, **run,
                   "served_tokens_per_s": run["tokens"] / run["wall_s"],
                   "tbt_p50_ms": 1e3 * statistics.median(gaps),
                   "tbt_p99_ms": 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
                   "server_cpu_ms_per_token": 1e3 * cpu / run["tokens"]}
            rows.append(row)
            measured[mode] = row
        moa, api = measured["moa-chain+lookup"], measured["api"]
        summary[f"clients={count}"] = {
            "served_tokens_per_s": round(moa["served_tokens_per_s"], 2),
            "api_tokens_per_s": round(api["served_tokens_per_s"], 2),
            "served_vs_api": round(moa["served_tokens_per_s"] / api["served_tokens_per_s"], 3),
            "tbt_p50_ms": round(moa["tbt_p50_ms"], 2), "tbt_p99_ms": round(moa["tbt_p99_ms"], 2),
            "api_tbt_p50_ms": round(api["tbt_p50_ms"], 2), "api_tbt_p99_ms": round(api["tbt_p99_ms"], 2),
            "server_cpu_ms_per_token": round(moa["server_cpu_ms_per_token"], 2),
            "api_server_cpu_ms_per_token": round(api["server_cpu_ms_per_token"], 2),
            "rtt_ms": rtt_ms, "bandwidth_mbit": bandwidth_mbit, "client": "moa-chain+lookup",
            "near_ties": {mode: measured[mode]["near_ties"] for mode in modes},
        }
    return summary, rows


def plot_users(summary: dict, ax_rate, ax_tbt, moa_label: str = "MoA clients (chain + lookup)",
               rate_title: str = "tokens/s served, all users") -> None:
    """Served tokens/s and p50 time between tokens against the number of users."""
    counts = [int(key.split("=")[1]) for key in summary]
    rows = list(summary.values())
    ax_rate.plot(counts, [r["served_tokens_per_s"] for r in rows], "o-", label=moa_label)
    ax_rate.plot(counts, [r["api_tokens_per_s"] for r in rows], "s--", label="plain API streams")
    ax_tbt.plot(counts, [r["tbt_p50_ms"] for r in rows], "o-", label="MoA clients p50")
    ax_tbt.plot(counts, [r["api_tbt_p50_ms"] for r in rows], "s--", label="API streams p50")
    for ax, title in ((ax_rate, rate_title), (ax_tbt, "time between tokens (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.set_xlabel("users at once")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
