"""The transformers runtime on this machine (CPU by default): plain decoding against n-gram,
independent LM, EAGLE-style and MoA TLI 0 / 1 drafters, as chains of K and as EAGLE-2 trees,
greedy, batch 1. Targets: the shipped demo models, or SmolLM2-135M-Instruct with the drafters
shipped for it (vllm_moa/assets/smollm2).

    python -m benchmarks.runtime_cpu [--prompts spec_bench/question.jsonl] [--num-prompts 16]
                                     [--max-new-tokens 96] [--profile]
    python -m benchmarks.runtime_cpu --target smollm2 \
        --prompts ../shared/data/specbench/mt_bench/question.jsonl ../shared/data/specbench/gsm8k/question.jsonl \
        --num-prompts 2 --heldout 2 --max-new-tokens 64 --drafters moa-tli0 eagle ngram \
        --chains 3 --trees 3,2,4 4,4,8 5,4,16 6,4,24 --profile

Prompts: the target's shipped held-out prompts (demo: stdlib files; SmolLM2: the drafters'
held-out chat and coding prompts), or --num-prompts from each Spec-Bench jsonl given with
--prompts (+ --heldout of the held-out ones), through the chat template for SmolLM2. For each
prompt, plain decoding and every configuration run back to back in the same process (so a noisy
neighbour slows both), and every output is checked equal to plain greedy decoding. Reports
acceptance length, per-position acceptance, tokens/s and the speedup over plain decoding (total
plain time / total speculative time, each configuration paired with its own plain runs; the
per-prompt median ratio too). Writes JSON with provenance (taken at start) and a PNG plot to
benchmarks/results/. --profile adds a cProfile of one MoA tree run: where the time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from benchmarks.provenance import provenance as common_provenance  # noqa: E402
from vllm_moa.chat import encode_prompt  # noqa: E402
from vllm_moa.decoding.chain import plain_greedy_generate  # noqa: E402
from vllm_moa.decoding.engine import SpeculativeEngine
from vllm_moa.decoding.results import summarize  # noqa: E402
from vllm_moa.decoding.retrieval import Retrieval  # noqa: E402
from vllm_moa.decoding.tree import DEFAULT_TREE, DraftSpec  # noqa: E402
from vllm_moa.models import load_drafter  # noqa: E402
from vllm_moa.packed_linear import weight_format  # noqa: E402
from vllm_moa.shipped import SHIPPED, SHIPPED_SMOLLM2  # noqa: E402
from vllm_moa.target import TargetModel  # noqa: E402
from vllm_moa.training.data import read_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DRAFTERS = ("moa-tli0", "moa-tli1", "eagle", "independent", "ngram")


def shapes(chain_lengths: list[int], trees: list[DraftSpec]) -> dict[str, DraftSpec]:
    out = {f"chain K={k}": DraftSpec.chain(k) for k in chain_lengths}
    for tree in trees:
        out[f"tree d={tree.depth} k={tree.top_k} b={tree.budget}"] = tree
    return out


def tree_spec(text: str) -> DraftSpec:
    """'DEPTH,TOP_K,BUDGET' -> an EAGLE-2 tree spec."""
    try:
        depth, top_k, budget = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tree is DEPTH,TOP_K,BUDGET (e.g. 5,4,16), got {text!r}") from None
    try:
        return DraftSpec.tree(depth, top_k, budget)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, nargs="+", default=None,
                        help="Spec-Bench jsonl files, N prompts from each (default: the target's shipped held-out prompts)")
    parser.add_argument("--heldout", type=int, default=0,
                        help="also take this many of the target's shipped held-out prompts (with --prompts)")
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts per file")
    parser.add_argument("--prompt-tokens", type=int, default=192, help="keep the last N prompt tokens")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--chains", type=int, nargs="+", default=[3, 5, 7])
    parser.add_argument("--trees", type=tree_spec, nargs="+", default=[DEFAULT_TREE],
                        metavar="DEPTH,TOP_K,BUDGET")
    parser.add_argument("--drafters", nargs="+", default=list(DRAFTERS),
                        help="shipped drafter names, LABEL=DIR (a drafter directory), 'ngram', 'hybrid:<name>': "
                             "lookup merged into that drafter's trees (decoding/retrieval.py), or 'int8:<name>' / 'bf16:<name>' "
                             "(also 'hybrid:int8:<name>'): the drafter on int8 / bf16 weights (packed_linear.weight_format)")
    parser.add_argument("--retrieval", type=Retrieval.model_validate_json, default=Retrieval(),
                        help="options of the hybrid rows, as JSON (e.g. '{\"min_ngram\": 1}')")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--target", choices=["demo", "smollm2"], default="demo")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # LABEL=DIR names a drafter directory that is not shipped (e.g. a training checkpoint) by LABEL
    directories = {}
    for i, name in enumerate(args.drafters):
        hybrid = name.startswith("hybrid:")
        label, _, directory = name.removeprefix("hybrid:").partition("=")
        if directory:
            directories[label] = Path(directory).expanduser()
            args.drafters[i] = ("hybrid:" if hybrid else "") + label
    prov = common_provenance(torch_threads=torch.get_num_threads())  # at start: the code that runs
    if args.prompts is None:
        sources = ["stdlib-heldout" if args.target == "demo" else "heldout"]
    else:
        sources = [p.parent.name or p.stem for p in args.prompts] + (["heldout"] if args.heldout else [])
    source = "-".join(sources)
    prefix = "runtime_cpu" if args.target == "demo" else f"runtime_cpu_{args.target}"
    out = args.out or ROOT / "benchmarks" / "results" / f"{prefix}_{source}.json"

    if args.target == "smollm2":
        from vllm_moa.targets import fetch_smollm2

        target_dir, drafters_dir = fetch_smollm2(), SHIPPED_SMOLLM2
    else:
        target_dir, drafters_dir = SHIPPED / "target", SHIPPED
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = TargetModel.from_pretrained(target_dir)
    heldout = [p if isinstance(p, str) else p["text"] for p in json.loads((drafters_dir / "heldout_prompts.json").read_text())]
    if args.prompts is None:
        texts = heldout[: args.num_prompts]
    else:
        texts = [t for path in args.prompts for t in read_prompts(path)[: args.num_prompts]] + heldout[: args.heldout]
    encode = (lambda t: encode_prompt(tokenizer, t)) if args.target == "smollm2" else (lambda t: tokenizer(t)["input_ids"])
    prompts = [encode(t)[-args.prompt_tokens :] for t in texts]
    configs = shapes(args.chains, args.trees)
    engines = {}
    for name in args.drafters:
        fmt, _, base = name.removeprefix("hybrid:").rpartition(":")  # fmt: "", "int8" or "bf16"
        path = directories.get(base, drafters_dir / base)
        drafter = "ngram" if base == "ngram" else load_drafter(path, target).eval()
        if fmt:
            weight_format(drafter, fmt)
        retrieval = args.retrieval if name.startswith("hybrid:") else None
        for shape_name, spec in configs.items():
            engines[(name, shape_name)] = SpeculativeEngine(target, drafter, spec, retrieval=retrieval)
    plain_greedy_generate(target, prompts[0], 16)  # warm-up
    for engine in engines.values():
        engine.generate([prompts[0]], 8)

    # every configuration is timed right after its own plain run on the same prompt, so a noisy
    # neighbour on the machine slows both sides of each ratio alike
    runs = {key: [] for key in engines}
    seconds = {key: 0.0 for key in engines}
    plain_seconds = {key: 0.0 for key in engines}
    ratios = {key: [] for key in engines}
    plain_total, plain_tokens = 0.0, 0
    for ids in tqdm(prompts, desc="prompts"):
        for key, engine in engines.items():
            plain = plain_greedy_generate(target, ids, args.max_new_tokens)
            started = time.perf_counter()
            result = engine.generate([ids], args.max_new_tokens)[0]
            elapsed = time.perf_counter() - started
            assert result.token_ids == plain.token_ids, f"{key}: output differs from plain greedy decoding"
            runs[key].append(result)
            seconds[key] += elapsed
            plain_seconds[key] += plain.seconds
            ratios[key].append(plain.seconds / elapsed)
            plain_total += plain.seconds
            plain_tokens += len(plain.token_ids)

    plain_tok_s = plain_tokens / plain_total
    rows = []
    for (name, shape_name), results in runs.items():
        spec = configs[shape_name]
        summary = summarize(results, seconds[(name, shape_name)], spec.depth)
        rows.append({
            "drafter": name, "draft": shape_name, "acceptance_length": round(summary["acceptance_length"], 3),
            "acceptance_by_position": [round(x, 3) for x in summary["acceptance_by_position"]],
            "tokens_per_s": round(summary["tokens_per_s"], 1),
            "plain_tokens_per_s_paired": round(summary["tokens"] / plain_seconds[(name, shape_name)], 1),
            "speedup": round(plain_seconds[(name, shape_name)] / seconds[(name, shape_name)], 3),
            "speedup_median_per_prompt": round(statistics.median(ratios[(name, shape_name)]), 3),
            "drafter_share": round(summary["drafter_share"], 3), "target_forwards": summary["target_forwards"],
        })
    best = {name: max((r for r in rows if r["drafter"] == name), key=lambda r: r["speedup"]) for name in args.drafters}
    tree_name = next((k for k in configs if k.startswith("tree")), None)
    tree_al = {r["drafter"]: r["acceptance_length"] for r in rows if r["draft"] == tree_name}
    report = {
        "benchmark": "runtime_cpu", "target": args.target,
        "prompts": source, "num_prompts": len(prompts), "prompt_tokens_max": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens, "batch": 1, "decoding": "greedy (outputs checked equal to plain)",
        "retrieval_of_hybrid_rows": args.retrieval.model_dump(),
        "plain_tokens_per_s": round(plain_tok_s, 1),
        "timing": "each configuration's run follows a plain run on the same prompt; speedup = paired time ratio",
        "rows": rows,
        "best_per_drafter": {k: {"draft": v["draft"], "speedup": v["speedup"], "acceptance_length": v["acceptance_length"]}
                             for k, v in best.items()},
        "tree_acceptance_ratio_moa_over_eagle": {
            f"{m}/eagle": round(tree_al[m] / tree_al["eagle"], 3) for m in ("moa-tli0", "moa-tli1")
            if m in tree_al and "eagle" in tree_al
        },
        "provenance": {**prov, "models": str(drafters_dir.relative_to(ROOT))},
    }
    if args.profile and "moa-tli0" in args.drafters and tree_name is not None:
        report["profile_moa_tli0_tree"] = profile(engines[("moa-tli0", tree_name)], prompts[:4], args.max_new_tokens)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(rows, list(configs), args.drafters, out.with_suffix(".png"), report)
    print(json.dumps({k: report[k] for k in ("plain_tokens_per_s", "best_per_drafter", "tree_acceptance_ratio_moa_over_eagle")}, indent=2))
    for r in rows:
        print(f"{r['drafter']:12s} {r['draft']:20s} AL {r['acceptance_length']:.2f}  {r['tokens_per_s']:7.1f} tok/s  "
              f"speedup {r['speedup']:.2f}x  drafter {r['drafter_share']:.0%}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


def profile(engine: SpeculativeEngine, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Where a MoA tree run spends its time: cumulative seconds of the runtime's main stages."""
    profiler = cProfile.Profile()
    profiler.enable()
    for ids in prompts:
        engine.generate([ids], max_new_tokens)
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = stats.total_tt
    stages = {
        "target forward (verification)": ("target.py", "forward"),
        "drafter: grow tree (SA/CA/LM head per level)": ("tree.py", "grow_tree"),
        "drafter: accept (LSA over new rows, compaction)": ("drafters.py", "accept"),
        "LSA (layer self-attention)": ("moa.py", "rows_from_kv"),
        "target LM head (in verification; drafters without a draft vocabulary)": ("target.py", "lm_head"),
        "tree masks / batching": ("tree.py", "verification_inputs"),
        "acceptance walk": ("verify.py", "greedy_accept"),
        "target cache commit": ("cache.py", "commit"),
    }
    found = {}
    for label, (file, func) in stages.items():
        cum = sum(v[3] for k, v in stats.stats.items() if k[0].endswith(file) and k[2] == func)
        found[label] = {"seconds": round(cum, 3), "share": round(cum / total, 3)}
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
    return {"total_s": round(total, 3), "stages": found, "top_ops_by_self_time": text.getvalue().splitlines()[-20:]}


def plot(rows: list[dict], shape_names: list[str], drafters: list[str], path: Path, report: dict) -> None:
    fig, (ax_al, ax_speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(shape_names)
    for j, shape_name in enumerate(shape_names):
        sel = {r["drafter"]: r for r in rows if r["draft"] == shape_name}
        xs = [i + j * width for i in range(len(drafters))]
        ax_al.bar(xs, [sel[d]["acceptance_length"] for d in drafters], width, label=shape_name)
        ax_speed.bar(xs, [sel[d]["speedup"] for d in drafters], width, label=shape_name)
    for ax, title in ((ax_al, "acceptance length (tokens / target forward)"), (ax_speed, "speedup over plain decoding")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(drafters))], drafters)
        ax.set_title(title)
    ax_speed.axhline(1.0, color="black", linewidth=0.8)
    ax_al.legend(fontsize=8)
    prov = report["provenance"]
    fig.suptitle(f"{report['target']} target, {report['prompts']} prompts x {report['max_new_tokens']} tokens, greedy, "
                 f"batch 1 - {prov['cpu']} {prov['torch_threads']} threads, commit {prov['commit'][:8]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
