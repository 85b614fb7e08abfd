"""The day a server sees: vLLM's CPU engine on SmolLM2 at concurrency 1 to 64 and under request
streams (Poisson arrivals at three rates), for every way a user can turn speculation on, against
no speculation measured first and last in every round.

    python -m benchmarks.vllm_cpu_sweep                          # 3 rounds: about 50 min on 2 cores
    python -m benchmarks.vllm_cpu_sweep --rounds 1 --concurrency 1 16 --rates 2 --out F.json   # a look

Configurations: `{"method": "moa"}` as a user writes it; the tree the README shows
(`moa_tree: {"depth": 5, "top_k": 4}`, 16 nodes); MoA alone at K = 4 fixed; vLLM's own
`num_speculative_tokens_per_batch_size` schedule on MoA + lookup (K = 4 up to 4 requests, 0
above); vLLM's n-gram (K = 3). A round runs "none", every configuration in an order rotated from
round to round, then "none" again; each is a fresh engine (one `vllm.LLM`), enforce_eager, fp32,
greedy, ignore_eos. By default a round's engines run one after another in one child process
(engine_host.py), each its whole day; with --side-by-side they live together in this process
(vLLM's engine core in-process) and take turns at every point, "none" first and last, so that
the machine's drift between two engines' runs at a point is seconds' worth, not tens of minutes'.
With --turns they take turns step by step instead (integration/serve/engine_turns.py): every
engine of the round, two without speculation among them, runs the point at once, the one whose
own clock is furthest behind stepping next, each timed only during its own steps, so that every
engine meets the same machine speed (this machine's wanders by ±10% within seconds).

Inside an engine: a warm-up pass, then one pass per concurrency c: the first max(c,
--min-prompts) held-out chat prompts (repeated beyond the 16 shipped), in groups of c, each
group generated to the end before the next (with --turns --in-flight: c requests kept in flight, a
finished one replaced at once by the next, as `vllm bench serve --max-concurrency c` keeps them:
a group's requests that speculation finishes early no longer leave it part-empty until its longest
ends); then the streams: --stream-requests requests, each
added at its Poisson arrival time (seeded, the same for every engine) with its own answer length
(uniform in --stream-tokens, seeded), while the engine runs the earlier ones
(integration/serve/request_stream.py).

Reported per configuration and point, over the rounds: tokens/s over the mean of that round's two
"none" engines (the median of the rounds, and every round's ratio), vLLM's mean time between a
request's outputs (the per-step timing of the pass), acceptance length; for streams, the mean
request latency and time per output token over "none"'s. Every output is checked equal to "none"'s.
Writes benchmarks/results/vllm_cpu_sweep_smollm2.{json,png} with provenance.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.provenance import ROOT, provenance  # noqa: E402
from benchmarks.vllm_cpu_engine import heldout_prompts_file, load_prompts  # noqa: E402
from vllm_moa.integration.serve.engine_host import EngineHost  # noqa: E402
from vllm_moa.integration.serve.engine_metrics import engine_collectors, show_only  # noqa: E402
from vllm_moa.integration.serve.engine_turns import (  # noqa: E402
    EngineTurns,
    OwnClock,
    TurnsResult,
    attach_clock,
    take_turns,
)
from vllm_moa.integration.serve.offline import (  # noqa: E402
    EngineResult,
    EngineRun,
    Meters,
    PassResult,
    RequestStreamSpec,
    SpecDecodeCounters,
    StreamResult,
    build_llm,
    pass_sizes,
    requests_of,
    resolved_speculative_config,
    run_pass,
    shutdown,
    stream_result,
)
from vllm_moa.integration.serve.request_stream import poisson_arrivals  # noqa: E402
from vllm_moa.integration.shell.moa_defaults import MOA_ALONE  # noqa: E402
from vllm_moa.shipped import SHIPPED_SMOLLM2  # noqa: E402

NONE = "none"
CONFIGS: dict[str, dict] = {
    "moa (defaults)": {"method": "moa"},
    "moa tree (README)": {"method": "moa", "num_speculative_tokens": 16, "moa_tree": {"depth": 5, "top_k": 4}},
    "moa K=4 fixed": {"method": "moa", "num_speculative_tokens": 4, **MOA_ALONE},
    "moa, vLLM's K by batch size": {"method": "moa", "num_speculative_tokens": 4,
                                    "num_speculative_tokens_per_batch_size": [[1, 4, 4], [5, 1024, 0]]},
    "ngram K=3": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
}


def build_run(target: str, config: dict | None, prompts: list[list[int]], args: argparse.Namespace,
              streams: list[RequestStreamSpec]) -> EngineRun:
    counts = [max(c, args.min_prompts) for c in args.concurrency]
    return EngineRun(target=target, speculative_config=config, prompts=prompts, max_tokens=args.max_tokens,
                     passes=[16, *args.concurrency], pass_prompts=[16, *counts], streams=streams,
                     engine={"dtype": "float32", "max_model_len": 2048, "max_num_seqs": max(args.concurrency),
                             "skip_tokenizer_init": True})


def stream_specs(args: argparse.Namespace) -> list[RequestStreamSpec]:
    rng = random.Random(1234)
    lengths = [rng.randint(*args.stream_tokens) for _ in range(args.stream_requests)]
    return [RequestStreamSpec(rate=rate, arrivals=poisson_arrivals(rate, args.stream_requests, seed=index),
                              max_tokens=lengths) for index, rate in enumerate(args.rates)]


def pass_record(done: PassResult) -> dict:
    tokens = sum(len(o) for o in done.outputs)
    return {"tokens_per_s": tokens / done.seconds, "seconds": done.seconds,
            "inter_token_seconds": done.inter_token_seconds, **draft_fields(done.spec_decode), "outputs": done.outputs}


def stream_record(stream: StreamResult | TurnsResult, spec_decode: SpecDecodeCounters) -> dict:
    """A stream's mean request latency, time per output token and to the first, its drafts."""
    latency = [f - a for f, a in zip(stream.finished, stream.arrival)]
    tpot = [(f - t) / max(1, len(o) - 1) for f, t, o in zip(stream.finished, stream.first_token, stream.outputs)]
    return {"mean_latency_s": statistics.mean(latency), "mean_time_per_output_token_s": statistics.mean(tpot),
            "mean_time_to_first_token_s": statistics.mean(t - a for t, a in zip(stream.first_token, stream.arrival)),
            "seconds": stream.seconds, **draft_fields(spec_decode), "outputs": stream.outputs}


def draft_fields(spec_decode: SpecDecodeCounters) -> dict:
    return {"drafts": spec_decode.drafts,
            "acceptance_length": spec_decode.acceptance_length if spec_decode.drafts else None}


def point_record(result: EngineResult) -> dict:
    """What one engine measured: per concurrency and per stream."""
    return {"passes": {str(done.concurrency): pass_record(done) for done in result.passes[1:]},
            "streams": {f"{stream.rate:g}": stream_record(stream) for stream in result.streams},
            "startup_seconds": result.startup_seconds, "speculative_config": result.speculative_config}


def round_order(args: argparse.Namespace, round_index: int) -> list[str]:
    """"none", the configurations rotated by the round, "none" again."""
    shift = round_index % len(args.configs)
    return [NONE, *args.configs[shift:], *args.configs[:shift], NONE]


def engines_one_after_another(target: str, prompts: list[list[int]], args: argparse.Namespace,
                              streams: list[RequestStreamSpec]) -> list[dict]:
    """Each engine of a round runs its whole day (every pass, then the streams) before the next starts,
    each a fresh `vllm.LLM` in the engine host's child."""
    engines = []
    with EngineHost(env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}) as host:
        for round_index in range(args.rounds):
            order = round_order(args, round_index)
            for position, name in enumerate(tqdm(order, desc=f"round {round_index + 1}/{args.rounds}", file=sys.stderr)):
                config = None if name == NONE else CONFIGS[name]
                result = host.run(build_run(target, config, prompts, args, streams), timeout=3600)
                engines.append({"round": round_index, "position": position, "name": name, **point_record(result)})
    return engines


def engines_side_by_side(target: str, prompts: list[list[int]], args: argparse.Namespace,
                         streams: list[RequestStreamSpec]) -> list[dict]:
    """A round's engines live together in one process (vLLM's engine core in-process) and take
    turns at every point: each runs the point's pass (or stream) in the round's order, "none" first
    and last, so the ratios at a point compare runs seconds apart, not tens of minutes. Each engine
    still runs the day an engine runs alone (a warm-up pass, concurrency 1 to 64, then the streams).
    Every round runs in a fresh process (spawned), its engines built with vLLM's n-gram last: vLLM's
    CPU platform failed to build an engine in a process where an n-gram engine had been built.
    Each finished round's records (without tokens) are written beside --out as they come."""
    engines = []
    one_round = turns_round if args.turns else side_by_side_round
    for round_index in range(args.rounds):
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            engines += pool.submit(one_round, target, prompts, args, streams, round_index).result()
        args.out.with_suffix(".rounds.json").write_text(json.dumps(strip_outputs(engines)))  # what is done so far
    return engines


def side_by_side_round(target: str, prompts: list[list[int]], args: argparse.Namespace,
                       streams: list[RequestStreamSpec], round_index: int) -> list[dict]:
    """One round of engines_side_by_side, in this process."""
    order = round_order(args, round_index)
    # vLLM's n-gram engines are built last: an engine built after one in the same process fails in
    # the CPU platform's Triton kernel rebinding (AttributeError in register_kernels)
    names = sorted(dict.fromkeys(order), key=lambda name: name != NONE and CONFIGS[name].get("method") == "ngram")
    runs = {name: build_run(target, None if name == NONE else CONFIGS[name], prompts, args, streams) for name in names}
    built, collectors = {}, {}
    for name, run in tqdm(runs.items(), desc=f"round {round_index + 1}/{args.rounds}: engines", file=sys.stderr):
        built[name] = build_llm(run)
        collectors[name] = engine_collectors()  # its own counters (engine_metrics.py)
    records = [{"round": round_index, "position": position, "name": name, "passes": {}, "streams": {},
                "startup_seconds": built[name][1], "speculative_config": resolved_speculative_config(
                    built[name][0].llm_engine.vllm_config.speculative_config)}
               for position, name in enumerate(order)]
    meters = dict.fromkeys(runs, Meters())
    requests = {name: requests_of(run) for name, run in runs.items()}
    try:
        for index, (size, count) in enumerate(tqdm(pass_sizes(runs[NONE]), desc="passes", file=sys.stderr)):
            for record in records if index else records[:-1]:  # the warm-up pass: once per engine
                name = record["name"]
                tokens, sampling = requests[name]
                show_only(collectors[name])
                done, meters[name] = run_pass(built[name][0], tokens[:count], sampling[:count], size, meters[name])
                if index:
                    record["passes"][str(done.concurrency)] = pass_record(done)
        for stream in tqdm(streams, desc="streams", file=sys.stderr):
            for record in records:
                name = record["name"]
                tokens, sampling = requests[name]
                show_only(collectors[name])
                done_stream, meters[name] = stream_result(built[name][0], tokens, sampling, stream, meters[name])
                record["streams"][f"{stream.rate:g}"] = stream_record(done_stream, done_stream.spec_decode)
    finally:
        for llm, _ in built.values():
            shutdown(llm)
    return records


def turns_round(target: str, prompts: list[list[int]], args: argparse.Namespace,
                streams: list[RequestStreamSpec], round_index: int) -> list[dict]:
    """One round with --turns, in this process: an engine per position of the round's order (two
    without speculation), each warmed up alone, then every point run by all of them at once,
    taking turns step by step on their own clocks (engine_turns.py)."""
    order = round_order(args, round_index)
    configs = [None if name == NONE else CONFIGS[name] for name in order]
    runs = [build_run(target, config, prompts, args, streams) for config in configs]
    # vLLM's n-gram engines are built last (side_by_side_round says why)
    build_order = sorted(range(len(order)), key=lambda i: bool(configs[i]) and configs[i].get("method") == "ngram")
    built, collectors = {}, {}
    for position in tqdm(build_order, desc=f"round {round_index + 1}/{args.rounds}: engines", file=sys.stderr):
        built[position] = build_llm(runs[position])
        collectors[position] = engine_collectors()
    records = [{"round": round_index, "position": position, "name": name, "passes": {}, "streams": {},
                "startup_seconds": built[position][1], "speculative_config": resolved_speculative_config(
                    built[position][0].llm_engine.vllm_config.speculative_config)}
               for position, name in enumerate(order)]
    requests = [requests_of(run) for run in runs]
    clocks = [OwnClock() for _ in order]
    meters = [Meters() for _ in order]

    def measured(position: int) -> Meters:
        show_only(collectors[position])
        return Meters.read(built[position][0])

    try:
        sizes = pass_sizes(runs[0])
        for position, record in enumerate(records):  # the warm-up pass, alone; it installs K by measured speed
            tokens, sampling = requests[position]
            show_only(collectors[position])
            _, meters[position] = run_pass(built[position][0], tokens[:sizes[0][1]], sampling[:sizes[0][1]],
                                           sizes[0][0], meters[position])
            record["own_clock"] = attach_clock(built[position][0], clocks[position])
        for size, count in tqdm(sizes[1:], desc="passes", file=sys.stderr):
            turns = [EngineTurns(built[p][0], requests[p][0][:count], requests[p][1][:count], clocks[p], group=size,
                                 in_flight=args.in_flight, tag=f"c{size}") for p in range(len(order))]
            for position, done in enumerate(take_turns(turns)):
                now = measured(position)
                records[position]["passes"][str(size)] = turns_pass_record(
                    done, now.spec_decode.minus(meters[position].spec_decode))
                meters[position] = now
        for stream in tqdm(streams, desc="streams", file=sys.stderr):
            count = len(stream.arrivals)
            turns = []
            for p in range(len(order)):
                params = [s.clone() for s in requests[p][1][:count]]
                for s, tokens in zip(params, stream.max_tokens):
                    s.max_tokens = tokens
                turns.append(EngineTurns(built[p][0], requests[p][0][:count], params, clocks[p],
                                         arrivals=stream.arrivals, tag=f"s{stream.rate:g}"))
            for position, done in enumerate(take_turns(turns)):
                now = measured(position)
                records[position]["streams"][f"{stream.rate:g}"] = {
                    **stream_record(done, now.spec_decode.minus(meters[position].spec_decode)), **step_fields(done)}
                meters[position] = now
    finally:
        for llm, _ in built.values():
            shutdown(llm)
    return records


def turns_pass_record(done: TurnsResult, spec_decode: SpecDecodeCounters) -> dict:
    """pass_record's fields for a pass run in turns: tokens/s on the engine's own clock, its steps'
    median time (vLLM's time between outputs would include the other engines' steps)."""
    return {"tokens_per_s": sum(len(o) for o in done.outputs) / done.seconds, "seconds": done.seconds,
            "inter_token_seconds": None, **step_fields(done), **draft_fields(spec_decode), "outputs": done.outputs}


def step_fields(done: TurnsResult) -> dict:
    return {"steps": len(done.step_seconds), "median_step_seconds": statistics.median(done.step_seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--min-prompts", type=int, default=6, help="requests per pass at least (low concurrency)")
    parser.add_argument("--rates", type=float, nargs="*", default=[1.0, 2.0, 4.0], help="stream rates, requests/s")
    parser.add_argument("--stream-requests", type=int, default=24)
    parser.add_argument("--stream-tokens", type=int, nargs=2, default=[16, 96], metavar=("MIN", "MAX"))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--side-by-side", action="store_true",
                        help="a round's engines in this process, taking turns at every point (less drift)")
    parser.add_argument("--turns", action="store_true",
                        help="a round's engines in this process, taking turns step by step on their own clocks")
    parser.add_argument("--in-flight", action="store_true",
                        help="with --turns: a pass keeps c requests in flight (a finished one replaced at once, as "
                             "`vllm bench serve --max-concurrency c`) instead of groups of c run to their end")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_cpu_sweep_smollm2.json")
    args = parser.parse_args()
    if args.in_flight and not args.turns:
        parser.error("--in-flight keeps requests in flight within engines taking turns: add --turns")
    args.side_by_side = args.side_by_side or args.turns
    if args.side_by_side:  # before vLLM is imported
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    if args.turns:  # in-process, vLLM drops torch to 1 thread unless told; its own worker uses every core
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))

    from vllm_moa.targets import fetch_smollm2

    origin = provenance()
    target = str(fetch_smollm2())
    heldout = heldout_prompts_file(SHIPPED_SMOLLM2 / "moa-tli0")
    base = load_prompts(Path(target), None, 16, 128, heldout)
    needed = max(max(args.concurrency), args.min_prompts, args.stream_requests, 16)
    prompts = [base[i % len(base)] for i in range(needed)]
    streams = stream_specs(args)
    engines = (engines_side_by_side if args.side_by_side else engines_one_after_another)(target, prompts, args, streams)
    rows = summarize(engines, args)
    report = {
        "benchmark": "vllm_cpu_sweep", "target": target, "prompts": str(heldout), "configs": CONFIGS,
        "concurrency": args.concurrency, "rounds": args.rounds, "max_tokens": args.max_tokens,
        "prompts_per_pass": {str(c): max(c, args.min_prompts) for c in args.concurrency},
        "prompt_tokens": [len(p) for p in base],
        "streams": [s.model_dump() for s in streams], "rows": rows,
        "config": {"dtype": "float32", "enforce_eager": True, "greedy": True, "ignore_eos": True,
                   "engines": "in one process, taking turns step by step, each on its own clock" if args.turns
                   else "side by side in one process, taking turns at every point" if args.side_by_side
                   else "one after another, each in the engine host's child",
                   "passes": f"{'c requests in flight' if args.in_flight else 'groups of c, each run to its end'}",
                   "VLLM_CPU_KVCACHE_SPACE": "1" if args.side_by_side else "2",
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                   # vLLM binds OpenMP threads only in a worker process of its own
                   "VLLM_CPU_OMP_THREADS_BIND": "not applied (in-process executor)" if args.side_by_side
                   else "0-1"},
        "provenance": origin,
        "engines": strip_outputs(engines),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    plot(rows, args, args.out.with_suffix(".png"))
    for row in rows:
        print(f"{row['config']:>30} {row['point']:>10}  x{row['speedup']:.2f} "
              f"({min(row['round_speedups']):.2f}-{max(row['round_speedups']):.2f})  same={row['equals_no_speculation']}")
    print(f"wrote {args.out}")
    differing = sorted({f"{r['config']} {r['point']}" for r in rows if not r["equals_no_speculation"]})
    if differing:
        print(f"FAILED: output differs from no speculation's: {', '.join(differing)}", file=sys.stderr)
        sys.exit(1)


def points(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(label, section, key): concurrency passes, then streams."""
    return ([(f"c={c}", "passes", str(c)) for c in args.concurrency]
            + [(f"{r:g} req/s", "streams", f"{r:g}") for r in args.rates])


def speed(measured: dict, section: str) -> float:
    """Higher is faster: tokens/s for passes, 1 / mean latency for streams."""
    return measured["tokens_per_s"] if section == "passes" else 1.0 / measured["mean_latency_s"]


def summarize(engines: list[dict], args: argparse.Namespace) -> list[dict]:
    rows = []
    reference = next(e for e in engines if e["name"] == NONE)
    for name in [NONE, *args.configs]:
        for label, section, key in points(args):
            per_round = []
            for round_index in range(args.rounds):
                nones = [e for e in engines if e["round"] == round_index and e["name"] == NONE]
                base = statistics.mean(speed(e[section][key], section) for e in nones)
                mine = [e for e in engines if e["round"] == round_index and e["name"] == name]
                per_round += [(speed(e[section][key], section) / base, e) for e in mine]
            ratios = [r for r, _ in per_round]
            runs = [e[section][key] for _, e in per_round]
            steps = step_ratios(engines, name, section, key, args.rounds)
            rows.append({
                "config": name, "point": label, "section": section, "speedup": statistics.median(ratios),
                "round_speedups": ratios,
                "acceptance_length": [m["acceptance_length"] for m in runs],
                "drafts": [m["drafts"] for m in runs],
                "inter_token_seconds": [m.get("inter_token_seconds") for m in runs],
                "mean_time_per_output_token_s": [m.get("mean_time_per_output_token_s") for m in runs],
                # --turns: the median step over that of the round's engines without speculation
                "median_step_over_none": statistics.median(steps) if steps else None, "round_step_ratios": steps,
                "equals_no_speculation": all(m["outputs"] == reference[section][key]["outputs"] for m in runs),
                # where a run's tokens part from no speculation's: enough to trace it (tie_check-style)
                "differences": [d for i, m in enumerate(runs)
                                for d in differences(m["outputs"], reference[section][key]["outputs"], i)],
            })
    return rows


def step_ratios(engines: list[dict], name: str, section: str, key: str, rounds: int) -> list[float]:
    """Per round, the configuration's median step time over the mean of the round's engines
    without speculation (runs with --turns record each engine's median step; else [])."""
    ratios = []
    for round_index in range(rounds):
        here = [e for e in engines if e["round"] == round_index]
        nones = [e[section][key].get("median_step_seconds") for e in here if e["name"] == NONE]
        mine = [e[section][key].get("median_step_seconds") for e in here if e["name"] == name]
        if None in nones + mine or not nones:
            return []
        ratios += [m / statistics.mean(nones) for m in mine]
    return ratios


def differences(got: list[list[int]], want: list[list[int]], round_index: int) -> list[dict]:
    """Per request whose tokens differ from the reference's: the round, the request's index, the
    first differing position, the tokens from there (3 of each) and the reference's prefix before."""
    found = []
    for request, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        if mine != theirs:
            at = next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            found.append({"round": round_index, "request": request, "position": at, "got": mine[at:at + 3],
                          "want": theirs[at:at + 3], "want_prefix": theirs[:at]})
    return found


def strip_outputs(engines: list[dict]) -> list[dict]:
    def without(section: dict) -> dict:
        return {k: {f: v for f, v in m.items() if f != "outputs"} for k, m in section.items()}

    return [{**e, "passes": without(e["passes"]), "streams": without(e["streams"])} for e in engines]


def plot(rows: list[dict], args: argparse.Namespace, path: Path) -> None:
    fig, (ax_c, ax_s) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    for index, name in enumerate([NONE, *args.configs]):
        style = {"marker": "o", "label": name, "color": f"C{index}"}
        for ax, section, xs in ((ax_c, "passes", args.concurrency), (ax_s, "streams", args.rates)):
            sel = [r for r in rows if r["config"] == name and r["section"] == section]
            if not sel:
                continue
            ys = [r["speedup"] for r in sel]
            ax.plot(xs, ys, **style)
            ax.fill_between(xs, [min(r["round_speedups"]) for r in sel], [max(r["round_speedups"]) for r in sel],
                            color=f"C{index}", alpha=0.15)
    for ax, title, xlabel in ((ax_c, "tokens/s over no speculation's", "concurrency"),
                              (ax_s, "streams: 1 / mean request latency over none's", "arrival rate, requests/s")):
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(0.98, color="grey", lw=0.8, ls="--")
        ax.set_xlabel(xlabel)
        ax.set_title(title, fontsize=10)
    ax_c.legend(fontsize=8)
    none = ("engines taking turns on their own clocks, none = mean of a round's two engines without speculation"
            if args.turns else "none = mean of a round's first and last engine")
    fig.suptitle(f"vLLM CPU engine, SmolLM2, greedy fp32: median of {args.rounds} rounds (band: every round), {none}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
