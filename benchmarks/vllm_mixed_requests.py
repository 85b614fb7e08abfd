"""Requests that differ in one batch: vLLM's CPU engine on SmolLM2 serving greedy requests beside
requests sampled at temperature 1.5 (MoA's drafts are almost never accepted there), with K by
request (integration/shell/request_gate.py) on and off, against no speculation.

    python -m benchmarks.vllm_mixed_requests                    # 3 rounds: about 30 min on 2 cores
    python -m benchmarks.vllm_mixed_requests --rounds 1 --concurrency 4 --out F.json   # a look

Request i of the held-out chat prompts is greedy for even i and sampled at T = 1.5 (seed i) for
odd i, so every group of c requests at once holds both kinds. Configurations: "none";
`{"method": "moa"}` as a user writes it with VLLM_MOA_DRAFTS_BY_REQUEST=1 (K by request); the same
with it 0, the default (every request of a drafting step verifies the step's K drafts). Files
written while K by request was on by default (commits 81c6440 to fce691d) name these "moa
(defaults: K by request)" and "moa, every request's drafts verified". A
round runs "none", the two configurations in an order rotated from round to round, then "none"
again; each is a fresh engine (engines with the same environment share one child process:
engine_host.py), enforce_eager, fp32, ignore_eos. Inside an engine: a warm-up pass, then one pass
per concurrency c over the same --prompts requests in groups of c (each group generated to the end:
its slowest request sets its time), then request streams (Poisson arrivals at --rates, each request
its own answer length in --stream-tokens, seeded, the same for every engine), as a server sees them.

Reported per configuration and concurrency, over the rounds: tokens/s over the mean of that
round's two "none" engines (the median of the rounds, and every round's ratio), the draft tokens
each kind of request verified (vLLM's per-request spec-decode metrics), vLLM's acceptance length;
per stream, "none"'s mean request latency over the configuration's (all requests, the greedy ones,
the sampled ones). Every greedy request's output is checked equal to "none"'s. Writes
benchmarks/results/vllm_mixed_requests_smollm2.{json,png} with provenance.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.provenance import ROOT, provenance  # noqa: E402
from benchmarks.vllm_cpu_engine import heldout_prompts_file, load_prompts  # noqa: E402
from vllm_moa.integration.serve.engine_host import EngineHost  # noqa: E402
from vllm_moa.integration.serve.offline import EngineResult, EngineRun, RequestStreamSpec  # noqa: E402
from vllm_moa.integration.serve.request_stream import poisson_arrivals  # noqa: E402
from vllm_moa.shipped import SHIPPED_SMOLLM2  # noqa: E402

NONE = "none"
GATE_ENV = "VLLM_MOA_DRAFTS_BY_REQUEST"
# name -> (speculative config, extra environment of its engines)
CONFIGS: dict[str, tuple[dict | None, dict[str, str]]] = {
    "moa, K by request": ({"method": "moa"}, {GATE_ENV: "1"}),
    "moa (defaults: every request's drafts verified)": ({"method": "moa"}, {GATE_ENV: "0"}),
}
SAMPLED_TEMPERATURE = 1.5
HOST_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}  # as the sweep's engines


def build_run(target: str, config: dict | None, prompts: list[list[int]], args: argparse.Namespace) -> EngineRun:
    engine = {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": max(args.concurrency),
              "skip_tokenizer_init": True}
    if config is not None:
        engine["per_request_spec_decode_metrics"] = "summary"
    return EngineRun(target=target, speculative_config=config, prompts=prompts, max_tokens=args.max_tokens,
                     temperature=[0.0 if i % 2 == 0 else SAMPLED_TEMPERATURE for i in range(len(prompts))],
                     seed=0, passes=[len(prompts), *args.concurrency], engine=engine, streams=stream_specs(args))


def stream_specs(args: argparse.Namespace) -> list[RequestStreamSpec]:
    rng = random.Random(1234)
    lengths = [rng.randint(*args.stream_tokens) for _ in range(args.prompts)]
    return [RequestStreamSpec(rate=rate, arrivals=poisson_arrivals(rate, args.prompts, seed=index), max_tokens=lengths)
            for index, rate in enumerate(args.rates)]


def point_record(result: EngineResult) -> dict:
    """What one engine measured, per concurrency."""
    passes = {}
    for done in result.passes[1:]:
        drafts = done.draft_tokens or [None] * len(done.outputs)
        greedy = [d for i, d in enumerate(drafts) if i % 2 == 0 and d is not None]
        sampled = [d for i, d in enumerate(drafts) if i % 2 == 1 and d is not None]
        passes[str(done.concurrency)] = {
            "tokens_per_s": sum(len(o) for o in done.outputs) / done.seconds, "seconds": done.seconds,
            "inter_token_seconds": done.inter_token_seconds,
            "draft_tokens_per_greedy_request": statistics.mean(greedy) if greedy else None,
            "draft_tokens_per_sampled_request": statistics.mean(sampled) if sampled else None,
            "acceptance_length": done.spec_decode.acceptance_length if done.spec_decode.drafts else None,
            "greedy_outputs": done.outputs[0::2]}
    streams = {}
    for stream in result.streams:
        latency = [f - a for f, a in zip(stream.finished, stream.arrival)]
        streams[f"{stream.rate:g}"] = {
            "mean_latency_s": statistics.mean(latency), "greedy_mean_latency_s": statistics.mean(latency[0::2]),
            "sampled_mean_latency_s": statistics.mean(latency[1::2]), "seconds": stream.seconds,
            "greedy_outputs": stream.outputs[0::2]}
    return {"passes": passes, "streams": streams, "startup_seconds": result.startup_seconds,
            "speculative_config": result.speculative_config}


def summarise_streams(rounds: list[dict], rates: list[float]) -> list[dict]:
    rows = []
    for name in CONFIGS:
        for rate in (f"{r:g}" for r in rates):
            ratios: dict[str, list[float]] = {"all": [], "greedy": [], "sampled": []}
            equal = True
            for record in rounds:
                nones = [record[key]["streams"][rate] for key in (f"{NONE} first", f"{NONE} last")]
                point = record[name]["streams"][rate]
                for kind, key in (("all", "mean_latency_s"), ("greedy", "greedy_mean_latency_s"),
                                  ("sampled", "sampled_mean_latency_s")):
                    ratios[kind].append(statistics.mean(n[key] for n in nones) / point[key])
                equal = equal and point["greedy_outputs"] == nones[0]["greedy_outputs"] == nones[1]["greedy_outputs"]
            rows.append({"config": name, "rate": float(rate),
                         "speedup_over_none": statistics.median(ratios["all"]), "rounds": ratios["all"],
                         "greedy_speedup_over_none": statistics.median(ratios["greedy"]),
                         "sampled_speedup_over_none": statistics.median(ratios["sampled"]),
                         "greedy_equals_no_speculation": equal})
    return rows


def summarise(rounds: list[dict], concurrency: list[int]) -> list[dict]:
    rows = []
    for name in CONFIGS:
        for c in map(str, concurrency):
            ratios, greedy, sampled, acceptance, equal = [], [], [], [], True
            for record in rounds:
                nones = [record[key]["passes"][c] for key in (f"{NONE} first", f"{NONE} last")]
                base = statistics.mean(n["tokens_per_s"] for n in nones)
                point = record[name]["passes"][c]
                ratios.append(point["tokens_per_s"] / base)
                greedy.append(point["draft_tokens_per_greedy_request"])
                sampled.append(point["draft_tokens_per_sampled_request"])
                acceptance.append(point["acceptance_length"])
                equal = equal and point["greedy_outputs"] == nones[0]["greedy_outputs"] == nones[1]["greedy_outputs"]
            rows.append({"config": name, "concurrency": int(c), "speedup_over_none": statistics.median(ratios),
                         "rounds": ratios, "draft_tokens_per_greedy_request": greedy,
                         "draft_tokens_per_sampled_request": sampled, "acceptance_length": acceptance,
                         "greedy_equals_no_speculation": equal})
    return rows


def plot(rows: list[dict], stream_rows: list[dict], path: Path) -> None:
    fig, (speed, drafts, streams) = plt.subplots(1, 3, figsize=(15, 4))
    for name in CONFIGS:
        mine = [r for r in stream_rows if r["config"] == name]
        xs = [r["rate"] for r in mine]
        streams.plot(xs, [r["speedup_over_none"] for r in mine], marker="o", label=name)
        streams.fill_between(xs, [min(r["rounds"]) for r in mine], [max(r["rounds"]) for r in mine], alpha=0.2)
    streams.axhline(1.0, color="grey", lw=0.8)
    streams.set(xlabel="requests/s (Poisson, half greedy, half T=1.5)", ylabel="none's mean latency / config's",
                title="request streams")
    streams.legend(fontsize=7)
    for name in CONFIGS:
        mine = [r for r in rows if r["config"] == name]
        xs = [r["concurrency"] for r in mine]
        speed.plot(xs, [r["speedup_over_none"] for r in mine], marker="o", label=name)
        speed.fill_between(xs, [min(r["rounds"]) for r in mine], [max(r["rounds"]) for r in mine], alpha=0.2)
        for kind, style in (("greedy", "-"), ("sampled", ":")):
            drafts.plot(xs, [statistics.mean(v for v in r[f"draft_tokens_per_{kind}_request"] if v is not None)
                             if any(v is not None for v in r[f"draft_tokens_per_{kind}_request"]) else 0
                             for r in mine], style, marker="o", label=f"{name}: {kind} (T={SAMPLED_TEMPERATURE})"
                        if kind == "sampled" else f"{name}: greedy")
    speed.axhline(1.0, color="grey", lw=0.8)
    speed.set_xticks([r["concurrency"] for r in rows], [str(r["concurrency"]) for r in rows])
    drafts.set_xticks([r["concurrency"] for r in rows], [str(r["concurrency"]) for r in rows])
    speed.set(xscale="linear", xlabel="requests at once (half greedy, half T=1.5)", ylabel="tokens/s over no speculation",
              title="median of rounds (band: every round)")
    drafts.set(xlabel="requests at once", ylabel="draft tokens verified per request",
               title="drafts per request, by kind")
    speed.legend(fontsize=7)
    drafts.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16, help="requests per pass")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rates", type=float, nargs="*", default=[2.0, 4.0], help="stream rates, requests/s")
    parser.add_argument("--stream-tokens", type=int, nargs=2, default=[32, 96], metavar=("MIN", "MAX"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_mixed_requests_smollm2.json")
    args = parser.parse_args()
    from vllm_moa.targets import fetch_smollm2

    target = fetch_smollm2()
    heldout = heldout_prompts_file(SHIPPED_SMOLLM2 / "moa-tli0")
    prompts = load_prompts(target, None, args.prompts, 512, heldout)
    prompts = (prompts * (args.prompts // len(prompts) + 1))[: args.prompts]
    meta = provenance(config={"concurrency": args.concurrency, "rounds": args.rounds, "prompts": args.prompts,
                       "max_tokens": args.max_tokens, "sampled_temperature": SAMPLED_TEMPERATURE,
                       "rates": args.rates, "stream_tokens": args.stream_tokens,
                       "configs": {k: {"speculative_config": v[0], "env": v[1]} for k, v in CONFIGS.items()},
                       "prompts_file": str(heldout.relative_to(ROOT))})
    hosts = {json.dumps(env, sort_keys=True): EngineHost(env={**HOST_ENV, **env}) for _, env in CONFIGS.values()}
    default_host = hosts[json.dumps({}, sort_keys=True)]
    rounds: list[dict] = []
    names = list(CONFIGS)
    with tqdm(total=args.rounds * (len(names) + 2), desc="engines") as bar:
        for index in range(args.rounds):
            order = names[index % len(names):] + names[: index % len(names)]
            record = {}
            for key, config, env in [(f"{NONE} first", None, {}), *[(n, *CONFIGS[n]) for n in order],
                                     (f"{NONE} last", None, {})]:
                host = hosts.get(json.dumps(env, sort_keys=True), default_host)
                record[key] = point_record(host.run(build_run(str(target), config, prompts, args), timeout=1800))
                bar.update()
            rounds.append(record)
            rows, stream_rows = summarise(rounds, args.concurrency), summarise_streams(rounds, args.rates)
            args.out.write_text(json.dumps({"provenance": meta, "rows": rows, "stream_rows": stream_rows,
                                            "rounds": rounds}, indent=1))
    for host in hosts.values():
        host.__exit__(None, None, None)
    plot(rows, stream_rows, args.out.with_suffix(".png"))
    for row in rows:
        print(f"{row['config']:40s} c={row['concurrency']:2d} {row['speedup_over_none']:.2f}x "
              f"rounds {[round(r, 2) for r in row['rounds']]} greedy drafts {row['draft_tokens_per_greedy_request']} "
              f"sampled drafts {row['draft_tokens_per_sampled_request']} equal {row['greedy_equals_no_speculation']}")
    for row in stream_rows:
        print(f"{row['config']:40s} {row['rate']:g} req/s {row['speedup_over_none']:.2f}x rounds "
              f"{[round(r, 2) for r in row['rounds']]} greedy {row['greedy_speedup_over_none']:.2f}x sampled "
              f"{row['sampled_speedup_over_none']:.2f}x equal {row['greedy_equals_no_speculation']}")


if __name__ == "__main__":
    main()
