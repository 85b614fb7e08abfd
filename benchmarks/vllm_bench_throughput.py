"""vLLM's own throughput benchmark (`vllm bench throughput`, the command vLLM users already run)
with "moa", on vLLM's CPU build and SmolLM2: no speculation, `{"method": "moa"}` and vLLM's n-gram.

    python -m benchmarks.vllm_bench_throughput                      # 3 rounds: about 20 min on 2 cores
    python -m benchmarks.vllm_bench_throughput --rounds 1 --max-num-seqs 64 --out F.json   # a look

Every run is the `vllm` script itself, as typed (examples in docs/vllm-plugin.md), over SmolLM2's
held-out chat prompts (the 16 shipped beside its drafter, repeated to --num-prompts) through the
target's chat template, as a ShareGPT-format file (`vllm bench throughput` has no "custom" text
dataset), every answer --output-len tokens long
(vLLM's throughput benchmark ignores EOS). Each --max-num-seqs limit is a point: at most that many
requests decode together. A round runs "none", the other configurations in an order rotated from
round to round, then "none" again; every run is a fresh engine (fp32, enforce_eager).

Reported per configuration and point: output tokens/s over the mean of its round's two "none"
runs (the median of the rounds and every round's ratio) and each run's own output. vLLM's
throughput benchmark does not compare outputs: identity with no speculation is the engine
tests' and the sweep's (benchmarks/vllm_cpu_sweep.py).
Writes benchmarks/results/vllm_bench_throughput_smollm2.{json,png} with provenance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.provenance import ROOT, provenance  # noqa: E402
from vllm_moa.shipped import SHIPPED_SMOLLM2  # noqa: E402

NONE = "none"
CONFIGS: dict[str, dict | None] = {
    "moa (defaults)": {"method": "moa"},
    "ngram K=3": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
}
ENGINE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"]


def write_dataset(path: Path, target: str, count: int) -> Path:
    """A ShareGPT-format file (the text datasets `vllm bench throughput` reads from a path): each
    conversation's first turn is a held-out prompt already through the target's chat template
    (the benchmark sends the text as it is), the held-out prompts repeated to `count`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    texts = [p if isinstance(p, str) else p["text"]
             for p in json.loads((SHIPPED_SMOLLM2 / "heldout_prompts.json").read_text())]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
             for t in texts]
    rows = [{"conversations": [{"from": "human", "value": chats[i % len(chats)]}, {"from": "gpt", "value": "-"}]}
            for i in range(count)]
    path.write_text(json.dumps(rows))
    return path


def bench(target: str, config: dict | None, max_num_seqs: int, dataset: Path, args, out: Path) -> dict:
    """One `vllm bench throughput` run; its results file, plus output tokens/s."""
    command = [str(Path(sys.executable).parent / "vllm"), "bench", "throughput", "--model", target, *ENGINE_ARGS,
               "--max-num-seqs", str(max_num_seqs), "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
               "--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
               "--output-json", str(out)]
    if config is not None:
        command += ["--speculative-config", json.dumps(config)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    ran = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if ran.returncode != 0:
        raise SystemExit(f"vllm bench throughput failed ({' '.join(command)}):\n{(ran.stdout + ran.stderr)[-3000:]}")
    result = json.loads(out.read_text())
    result["output_tokens_per_second"] = result["num_requests"] * args.output_len / result["elapsed_time"]
    return result


def summarise(runs: list[dict], points: list[int]) -> list[dict]:
    rows = []
    for name in CONFIGS:
        for seqs in points:
            ratios = []
            for r in sorted({run["round"] for run in runs}):
                mine = [x for x in runs if x["round"] == r and x["config"] == name and x["max_num_seqs"] == seqs]
                nones = [x for x in runs if x["round"] == r and x["config"] == NONE and x["max_num_seqs"] == seqs]
                if mine and nones:
                    base = statistics.mean(x["output_tokens_per_second"] for x in nones)
                    ratios.append(mine[0]["output_tokens_per_second"] / base)
            rows.append({"config": name, "max_num_seqs": seqs, "speedup_over_none": statistics.median(ratios),
                         "rounds": [round(x, 3) for x in ratios]})
    return rows


def plot(rows: list[dict], points: list[int], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in CONFIGS:
        mine = [r for r in rows if r["config"] == name]
        (line,) = ax.plot(points, [r["speedup_over_none"] for r in mine], marker="o", label=name)
        for r in mine:  # every round's ratio, in its configuration's colour
            ax.scatter([r["max_num_seqs"]] * len(r["rounds"]), r["rounds"], s=10, alpha=0.4, color=line.get_color())
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("--max-num-seqs (requests decoding together)")
    ax.set_ylabel("output tokens/s over no speculation")
    ax.set_title("vllm bench throughput, vLLM CPU, SmolLM2")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_bench_throughput_smollm2.json")
    args = parser.parse_args(argv)
    from vllm_moa.targets import fetch_smollm2

    target = str(fetch_smollm2())
    # at the start: the code that runs, whatever changes in the tree during the run
    origin = provenance(target="SmolLM2-135M-Instruct", configs={NONE: None, **CONFIGS}, engine_args=ENGINE_ARGS,
                        num_prompts=args.num_prompts, output_len=args.output_len, rounds=args.rounds,
                        prompts="SmolLM2's held-out chat prompts (shipped beside its drafter)")
    names = list(CONFIGS)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        dataset = write_dataset(Path(tmp) / "prompts.json", target, args.num_prompts)
        plan = []
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            plan += [(r, seqs, name) for seqs in args.max_num_seqs for name in [NONE, *order, NONE]]
        for i, (r, seqs, name) in enumerate(tqdm(plan, desc="vllm bench throughput runs")):
            result = bench(target, CONFIGS.get(name), seqs, dataset, args, Path(tmp) / f"{i}.json")
            runs.append({"round": r, "max_num_seqs": seqs, "config": name, **result})
    rows = summarise(runs, args.max_num_seqs)
    record = {"provenance": origin, "rows": rows, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    plot(rows, args.max_num_seqs, args.out.with_suffix(".png"))
    for row in rows:
        print(f"{row['config']:>16}  max_num_seqs {row['max_num_seqs']:>3}: {row['speedup_over_none']:.3f}x  "
              f"(rounds {row['rounds']})")


if __name__ == "__main__":
    main()
