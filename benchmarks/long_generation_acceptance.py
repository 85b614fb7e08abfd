"""Acceptance by output position over long generations (1-2k tokens): MoA against EAGLE-style.

    python -m benchmarks.long_generation_acceptance --specbench ../shared/data/specbench \
        [--categories writing humanities] [--num-prompts 8] [--max-new-tokens 1536] [--bin 128] \
        [--windows 256] [--no-lookup]
    python -m benchmarks.long_generation_acceptance ... --set sum --categories summarization   # long prompts
    python -m benchmarks.long_generation_acceptance ... --categories writing humanities coding --spread \
        --max-new-tokens 2048 --windows 256 --out ...   # hours: each finished run is kept in --log
                                                       # (out.runs.json); run it again to resume

Drafters' acceptance is reported to decay over a few thousand output tokens (DFlash, EAGLE-3,
PARD); MoA reads the target's own KV cache at every layer, so it may hold up better. Both shipped
SmolLM2 drafters trained on sequences of at most 320 tokens, so every position past that is new to
both.

SmolLM2-135M-Instruct answers the first turn of Spec-Bench mt_bench questions of the given
categories (never trained on; read from the path given), chat-templated, greedily for
`--max-new-tokens` tokens. The end-of-turn token does not stop it: the target goes on (usually a
new turn), which keeps every row the same length; the first end of turn of each answer is recorded
and acceptance is also reported over the answers alone (rounds before it). Every drafter x draft
shape must reproduce plain greedy decoding token for token. n-gram lookup runs beside them as the
gauge of repetition: how much of each stretch of text repeats earlier text; each model drafter's
tree also runs with lookup merged into it (`Retrieval()`, the runtime's default).

Each verification round is binned by the output position it starts at (`--bin` tokens per bin);
a bin's acceptance length is its accepted tokens (+1 per round) over its rounds. JSON + PNG in
benchmarks/results/. Sequences run as one ragged batch (acceptance does not depend on batching;
time is not measured).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from benchmarks.provenance import ROOT, provenance  # noqa: E402
from benchmarks.run_log import RunLog  # noqa: E402
from vllm_moa.chat import encode_prompt  # noqa: E402
from vllm_moa.decoding.engine import SpeculativeEngine  # noqa: E402
from vllm_moa.decoding.results import GenerationResult  # noqa: E402
from vllm_moa.decoding.retrieval import Retrieval  # noqa: E402
from vllm_moa.decoding.tree import DraftSpec  # noqa: E402
from vllm_moa.models import load_drafter  # noqa: E402
from vllm_moa.shipped import SHIPPED_SMOLLM2  # noqa: E402
from vllm_moa.target import TargetModel  # noqa: E402
from vllm_moa.targets import fetch_smollm2  # noqa: E402

TRAINED_MAX_LENGTH = 320  # the longest sequence either shipped drafter trained on (assets/smollm2/README.md)


def read_questions(path: Path, categories: list[str], count: int, spread: bool = False) -> list[str]:
    """The first turn of the first `count` Spec-Bench questions whose category is one of those given
    (`spread`: taken from the categories in turn, the first of each, then the second, ...)."""
    by_category: dict[str, list[str]] = {c: [] for c in categories}
    questions = []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record.get("category") in categories:
            questions.append(record["turns"][0])
            by_category[record["category"]].append(record["turns"][0])
    if spread:
        questions = [q for i in range(max(map(len, by_category.values()), default=0))
                     for c in categories if i < len(by_category[c]) for q in [by_category[c][i]]]
    if len(questions) < count:
        raise SystemExit(f"{path} has {len(questions)} questions in {categories}, {count} asked for")
    return questions[:count]


def drafter_path(name: str) -> Path:
    """A drafter directory, or the name of a shipped SmolLM2 drafter."""
    return Path(name) if Path(name).is_dir() else SHIPPED_SMOLLM2 / name


def acceptance_by_bin(results: list[GenerationResult], bin_size: int, ends: list[int] | None = None) -> list[dict]:
    """Rounds binned by the output position each starts at: per bin, rounds and acceptance length.
    With `ends` (one output position per result), only rounds that start before it count."""
    gained: dict[int, int] = {}
    rounds: dict[int, int] = {}
    for i, result in enumerate(results):
        position = 0
        for accepted in result.accepted_per_forward:
            if ends is not None and position >= ends[i]:
                break
            index = position // bin_size
            gained[index] = gained.get(index, 0) + accepted
            rounds[index] = rounds.get(index, 0) + 1
            position += accepted
    return [{"start": index * bin_size, "rounds": rounds[index],
             "acceptance_length": round(gained[index] / rounds[index], 3)} for index in sorted(rounds)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specbench", type=Path, required=True, help="folder with mt_bench/question.jsonl")
    parser.add_argument("--set", default="mt_bench", help="the Spec-Bench set (a folder with question.jsonl)")
    parser.add_argument("--categories", nargs="+", default=["writing", "humanities"])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=1536)
    parser.add_argument("--bin", type=int, default=128, help="output tokens per bin")
    parser.add_argument("--chain", type=int, default=3, help="chain depth K")
    parser.add_argument("--tree", type=int, nargs=3, default=[5, 4, 16], metavar=("DEPTH", "TOP_K", "BUDGET"))
    parser.add_argument("--drafters", nargs="+", default=["moa-tli0", "eagle"], help="shipped names or directories")
    parser.add_argument("--windows", type=int, nargs="*", default=[],
                        help="each MoA drafter also runs with these attention windows (its attention_window set "
                             "after loading: a mask, no weight changes)")
    parser.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True,
                        help="also run each model drafter's tree with n-gram lookup merged in")
    parser.add_argument("--spread", action="store_true", help="prompts from the categories in turn (else in file order)")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks" / "results" / "long_generation_acceptance_smollm2.json")
    parser.add_argument("--log", type=Path, help="finished runs, kept as they finish: a run resumes from it "
                                                 "(default: --out with .runs.json; commit it to resume elsewhere)")
    args = parser.parse_args()

    origin = provenance(torch_threads=torch.get_num_threads())  # at the start: the code that runs
    folder = fetch_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    target = TargetModel.from_pretrained(folder)
    texts = read_questions(args.specbench / args.set / "question.jsonl", args.categories, args.num_prompts, args.spread)
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    log = RunLog(args.log or args.out.with_suffix(".runs.json"),
                 {"prompts": prompts, "max_new_tokens": args.max_new_tokens, "chain": args.chain, "tree": args.tree,
                  "drafters": args.drafters, "windows": args.windows, "lookup": args.lookup})
    drafters = {Path(n).name: load_drafter(drafter_path(n), target).eval() for n in args.drafters}
    for n in [n for n in args.drafters if hasattr(drafters[Path(n).name], "attention_window")]:
        for window in args.windows:
            windowed = drafters[f"{Path(n).name} W={window}"] = load_drafter(drafter_path(n), target).eval()
            windowed.attention_window = window
    drafters["ngram"] = "ngram"
    tree = DraftSpec.tree(*args.tree)
    shapes = {f"chain K={args.chain}": DraftSpec.chain(args.chain), f"tree d={tree.depth} k={tree.top_k} b={tree.budget}": tree}

    started = time.time()
    if "reference" not in log.values:
        log.keep("reference", [r.token_ids for r in SpeculativeEngine(target, None).generate(prompts, args.max_new_tokens)])
    reference = log.values["reference"]
    end_of_turn = tokenizer.eos_token_id
    ends = [ids.index(end_of_turn) + 1 if end_of_turn in ids else len(ids) for ids in reference]
    print(f"plain greedy done in {time.time() - started:.0f} s; first end of turn at {ends}", flush=True)
    rows = []
    runs = [(name, drafter, shape, spec, None) for name, drafter in drafters.items() for shape, spec in shapes.items()
            if not (name == "ngram" and spec is tree)]
    runs += [(f"{name} + lookup", drafter, shape, tree, Retrieval()) for name, drafter in drafters.items()
             if name != "ngram" and args.lookup for shape, spec in shapes.items() if spec is tree]
    for drafter_name, drafter, shape_name, spec, retrieval in tqdm(runs):
        key = f"{drafter_name}/{shape_name}"
        if not log.has(key):  # each finished run is kept at once (the log): a restart skips it
            results = SpeculativeEngine(target, drafter, spec, retrieval=retrieval).generate(prompts, args.max_new_tokens)
            if [r.token_ids for r in results] != reference:
                raise AssertionError(f"{key}: output differs from greedy decoding")
            log.add(key, {"accepted_per_forward": [r.accepted_per_forward for r in results]})
        results = [GenerationResult(token_ids=[], accepted_per_forward=accepted)
                   for accepted in log.row(key)["accepted_per_forward"]]
        forwards = sum(len(r.accepted_per_forward) for r in results)
        rows.append({"drafter": drafter_name, "draft": shape_name,
                     "acceptance_length": round(sum(sum(r.accepted_per_forward) for r in results) / forwards, 3),
                     "by_position": acceptance_by_bin(results, args.bin),
                     "answers_only_by_position": acceptance_by_bin(results, args.bin, ends)})
        print(f"{drafter_name:10s} {shape_name:18s} AL {rows[-1]['acceptance_length']:.3f} by bin "
              f"{[b['acceptance_length'] for b in rows[-1]['by_position']]}", flush=True)
    report = {
        "benchmark": "long_generation_acceptance", "target": "SmolLM2-135M-Instruct (vllm-moa fetch smollm2, fp32)",
        "prompts": {"set": f"Spec-Bench {args.set}, first turn", "categories": args.categories,
                    "count": len(prompts), "prompt_tokens": [len(p) for p in prompts]},
        "max_new_tokens": args.max_new_tokens, "bin_tokens": args.bin,
        "decoding": "greedy, the end-of-turn token does not stop generation; every output checked equal to plain "
                    "greedy decoding; one ragged batch",
        "first_end_of_turn": ends,
        "drafters_trained_on_at_most_tokens": TRAINED_MAX_LENGTH,
        "drafters": {n: str(Path(n) if Path(n).is_dir() else drafter_path(n).relative_to(ROOT)) for n in args.drafters},
        "attention_windows": {"windows": args.windows,
                              "meaning": "'<drafter> W=<w>': the same drafter with attention_window = w set after "
                                         "loading (SA reads the last w positions, CA the last w rows; trained "
                                         "without a window)"},
        "rows": rows, "wall_time_s": round(time.time() - started, 1),
        "runs_made_at_commits": log.commits(),  # a resumed run's rows may come from several sessions
        "provenance": origin,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(report: dict, path: Path) -> None:
    shapes = list(dict.fromkeys(r["draft"] for r in report["rows"]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.2), squeeze=False)
    # a drafter with lookup merged: its drafter's color, dotted
    colors = {name: f"C{i}" for i, name in enumerate(dict.fromkeys(r["drafter"].split(" + ")[0] for r in report["rows"]))}
    for ax, shape in zip(axes[0], shapes):
        for row in (r for r in report["rows"] if r["draft"] == shape):
            bins = row["by_position"]
            ax.plot([b["start"] + report["bin_tokens"] / 2 for b in bins], [b["acceptance_length"] for b in bins],
                    marker="o", markersize=3, color=colors[row["drafter"].split(" + ")[0]], label=row["drafter"],
                    linestyle="--" if row["drafter"] == "ngram" else ":" if "lookup" in row["drafter"] else "-")
        prompt_tokens = report["prompts"]["prompt_tokens"]  # the training length counts the prompt's tokens
        ax.axvline(report["drafters_trained_on_at_most_tokens"] - sum(prompt_tokens) / len(prompt_tokens),
                   color="gray", linewidth=0.8, linestyle=":")
        ax.set_xlabel("output position (tokens)")
        ax.set_title(f"{shape}: acceptance length by position")
        ax.legend(fontsize=8)
    prov = report["provenance"]
    fig.suptitle(f"SmolLM2-135M-Instruct, {report['prompts']['count']} mt_bench prompts x {report['max_new_tokens']} "
                 f"tokens, greedy; dotted: where the sequences pass the longest training sequence - commit {prov['commit'][:8]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
