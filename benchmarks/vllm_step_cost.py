"""What a step that drafts nothing costs a "moa" engine, against a step of an engine without
speculation: vLLM's CPU engine, SmolLM2, at batch sizes where speculation turns itself off.

    python -m benchmarks.vllm_step_cost                            # 16, 32 and 64 requests, 5 rounds
    python -m benchmarks.vllm_step_cost --batch 32 --rounds 2      # a quick look

Engine-to-engine drift on a small machine is as large as the effect (a few %), so every engine
lives in this one process (vLLM's engine core in-process, VLLM_ENABLE_V1_MULTIPROCESSING=0), side
by side, and their batches alternate: each round runs every arm once, in an order rotated from
round to round. An arm is an engine plus its environment:

    none                          no speculation
    moa, no drafts                {"method": "moa"} with vLLM's own schedule at K = 0 for every
                                  batch size: a "moa" engine that drafts nothing
    moa, no drafts, vLLM sampler  the same engine with VLLM_MOA_PLAIN_SAMPLER=0: steps without
                                  drafts through vLLM's rejection sampler, as vLLM 0.32 does
    moa (defaults)                {"method": "moa"}: K by measured speed (probes included)
    ngram, no drafts              vLLM's n-gram at K = 0 for every batch size (vLLM's own machinery)

A batch is B requests submitted at once (greedy, ignore_eos, --max-tokens each), driven through
vLLM's public LLMEngine.add_request / step; every step's wall time is recorded. A step's cost
is the median of the batch's decode steps (all requests decoding); the arm's per-step median
over all rounds, and its ratio to "none"'s, are reported, with each round's ratio (the spread).
Every arm's tokens are checked equal to "none"'s. Writes
benchmarks/results/vllm_step_cost_smollm2.{json,png} with provenance and every step's time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engines side by side in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.provenance import ROOT, provenance  # noqa: E402
from benchmarks.vllm_cpu_engine import heldout_prompts_file, load_prompts  # noqa: E402
from vllm_moa.shipped import SHIPPED_SMOLLM2  # noqa: E402

NO_DRAFTS = [[1, 1024, 0]]  # vLLM's num_speculative_tokens_per_batch_size: K = 0 at every batch size
ENGINES = {
    "none": None,
    "moa, no drafts": {"method": "moa", "num_speculative_tokens_per_batch_size": NO_DRAFTS},
    "moa (defaults)": {"method": "moa"},
    "ngram, no drafts": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                         "num_speculative_tokens_per_batch_size": NO_DRAFTS},
}
# arm -> (engine, environment while its batches run)
ARMS = {
    "none": ("none", {}),
    "moa, no drafts": ("moa, no drafts", {}),
    "moa, no drafts, vLLM sampler": ("moa, no drafts", {"VLLM_MOA_PLAIN_SAMPLER": "0"}),
    "moa (defaults)": ("moa (defaults)", {}),
    "ngram, no drafts": ("ngram, no drafts", {}),
}


def run_batch(llm, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[list[float], list[bool], list[list[int]]]:
    """B requests at once through LLMEngine's public add_request / step -> (every step's seconds,
    whether each step was a decode step of the whole batch: every request had its first token
    before it and none had finished, token ids per request)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=ids), params)
    seconds, decoding, generated, finished = [], [], {}, {}
    while engine.has_unfinished_requests():
        whole_batch = len(generated) == len(prompts) and not finished
        start = time.perf_counter()
        done = engine.step()
        seconds.append(time.perf_counter() - start)
        decoding.append(whole_batch)
        for output in done:
            generated[output.request_id] = list(output.outputs[0].token_ids)
            if output.finished:
                finished[output.request_id] = generated[output.request_id]
    return seconds, decoding, [finished[f"{tag}-{i}"] for i in range(len(prompts))]


def decode_median(seconds: list[float], decoding: list[bool]) -> float:
    """The median of a batch's decode steps (all requests decoding)."""
    return statistics.median(s for s, d in zip(seconds, decoding) if d)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_step_cost_smollm2.json")
    args = parser.parse_args()

    from vllm import LLM

    from vllm_moa.targets import fetch_smollm2

    origin = provenance()
    target = fetch_smollm2()
    heldout = heldout_prompts_file(SHIPPED_SMOLLM2 / "moa-tli0")
    base = load_prompts(target, None, 16, args.prompt_tokens, heldout)
    engine_args = {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": max(args.batch),
                   "enforce_eager": True, "skip_tokenizer_init": True}
    wanted = dict.fromkeys(ARMS[arm][0] for arm in ["none", *args.arms])
    engines = {name: LLM(model=str(target), speculative_config=ENGINES[name], **engine_args)
               for name in tqdm(wanted, desc="engines", file=sys.stderr)}
    arms = list(dict.fromkeys(["none", *args.arms]))
    records = []
    for batch in args.batch:
        prompts = [base[i % len(base)] for i in range(batch)]
        for name in wanted:  # a warm-up batch per engine at this size
            run_batch(engines[name], prompts, 8, f"warm-{name}-{batch}")
        for round_index in tqdm(range(args.rounds), desc=f"batch {batch}", file=sys.stderr):
            order = arms[round_index % len(arms):] + arms[:round_index % len(arms)]
            for arm in order:
                engine, env = ARMS[arm]
                saved = {key: os.environ.get(key) for key in env}
                os.environ.update(env)
                try:
                    seconds, decoding, outputs = run_batch(engines[engine], prompts, args.max_tokens,
                                                          f"{arm}-{batch}-{round_index}")
                finally:
                    for key, value in saved.items():
                        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
                records.append({"arm": arm, "batch": batch, "round": round_index, "position": order.index(arm),
                                "step_seconds": seconds, "decoding": decoding,
                                "decode_step_median": decode_median(seconds, decoding),
                                "outputs": outputs})
    rows = summarize(records, arms, args.batch)
    report = {
        "benchmark": "vllm_step_cost", "target": str(target), "arms": {a: {"engine": ENGINES[ARMS[a][0]],
                                                                          "env": ARMS[a][1]} for a in arms},
        "batches": args.batch, "rounds": args.rounds, "max_tokens": args.max_tokens,
        "prompt_tokens": [len(p) for p in base], "rows": rows,
        "config": {"dtype": "float32", "enforce_eager": True, "greedy": True, "ignore_eos": True,
                   "engines_in_one_process": True, "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"],
                   "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")},
        "provenance": origin,
        "records": [{k: v for k, v in r.items() if k != "outputs"} for r in records],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    plot(rows, arms, args.out.with_suffix(".png"))
    for row in rows:
        print(f"{row['arm']:>30} B={row['batch']:>2}  step {row['step_median_ms']:6.2f} ms  "
              f"x{row['step_over_none']:.3f} (rounds {min(row['round_ratios']):.3f}-{max(row['round_ratios']):.3f})  "
              f"same={row['equals_no_speculation']}")
    print(f"wrote {args.out}")
    differing = [f"{r['arm']} B={r['batch']}" for r in rows if not r["equals_no_speculation"]]
    if differing:
        print(f"FAILED: output differs from no speculation's: {', '.join(differing)}", file=sys.stderr)
        sys.exit(1)


def summarize(records: list[dict], arms: list[str], batches: list[int]) -> list[dict]:
    """Per arm and batch size: the median decode step over all rounds, its ratio to "none"'s, and
    each round's ratio to that round's "none" batch."""
    rows = []
    for batch in batches:
        mine = [r for r in records if r["batch"] == batch]
        none = {r["round"]: r for r in mine if r["arm"] == "none"}
        reference = none[0]["outputs"]
        none_median = statistics.median(r["decode_step_median"] for r in none.values())
        for arm in arms:
            runs = [r for r in mine if r["arm"] == arm]
            median = statistics.median(r["decode_step_median"] for r in runs)
            rows.append({
                "arm": arm, "batch": batch, "step_median_ms": 1e3 * median,
                "step_over_none": median / none_median,
                "round_ratios": [r["decode_step_median"] / none[r["round"]]["decode_step_median"] for r in runs],
                "tokens_per_s": [batch * len(r["outputs"][0]) / sum(r["step_seconds"]) for r in runs],
                "equals_no_speculation": all(r["outputs"] == reference for r in runs),
            })
    return rows


def plot(rows: list[dict], arms: list[str], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    batches = sorted({r["batch"] for r in rows})
    width = 0.8 / len(arms)
    for index, arm in enumerate(arms):
        sel = [next(r for r in rows if r["arm"] == arm and r["batch"] == b) for b in batches]
        xs = [i + (index - (len(arms) - 1) / 2) * width for i in range(len(batches))]
        ys = [r["step_over_none"] for r in sel]
        low = [y - min(r["round_ratios"]) for y, r in zip(ys, sel)]
        high = [max(r["round_ratios"]) - y for y, r in zip(ys, sel)]
        ax.bar(xs, ys, width, yerr=[low, high], capsize=3, label=arm, color=f"C{index}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.02, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(batches)), [f"{b} requests" for b in batches])
    ax.set_ylabel("decode step time / no speculation's")
    ax.set_ylim(0.9, max(1.1, max(max(r["round_ratios"]) for r in rows) + 0.02))
    ax.set_title("vLLM CPU engine, SmolLM2: a step that drafts nothing (median; bars: each round's ratio)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
