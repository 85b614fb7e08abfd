"""The transformers runtime at batch 1 and above on SmolLM2-135M-Instruct (CPU, greedy): plain
decoding through the same batched engine (no drafter) against MoA, lookup + MoA (hybrid),
EAGLE-style and n-gram drafters, as chains of K = 3 and one small tree.

    python -m benchmarks.runtime_batch_cpu [--prompts ../shared/data/specbench/mt_bench/question.jsonl] \
        [--batches 1 8 16] [--max-new-tokens 64] [--drafters moa-tli0 hybrid:moa-tli0 ngram] [--adaptive] \
        [--sequential-drafting]

Prompts: the shipped drafters' held-out prompts (default), or a Spec-Bench question.jsonl;
chat-templated, batch b takes the first b (cycled if there are fewer). --adaptive runs every
configuration a second time with SpeculativeEngine(..., adaptive=True): each round's depth,
plain decoding included, chosen from measured costs and acceptance (decoding/speed_control.py);
its rows also give the share of rounds it decoded plainly. Drafters whose sessions draft together
(MoA TLI=0, alone or with lookup: decoding/drafters.propose_all) run one drafter forward per tree
level for the whole batch; --sequential-drafting adds rows with batch_drafting=False (one
sequence at a time, as before) for them at batch > 1.

For each batch size B, B prompts run as one ragged batch: plain and each configuration in pairs,
the plain run first in even pairs and second in odd ones (the second run of a pair can read 5-10%
off the first on these machines, whichever engine it is); every sequence's output is checked
equal to plain greedy decoding. Throughput = generated tokens / wall time of the batch; speedup =
time ratio against the plain runs of the same pairs (over all repeats; each repeat's ratio too).
--control adds, per batch size, a second plain engine paired the same way: its "speedup" is what
this machine's noise alone gives. Writes benchmarks/results/runtime_batch_cpu_smollm2.{json,png}
with provenance.
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
from vllm_moa.chat import encode_prompt  # noqa: E402
from vllm_moa.decoding.engine import SpeculativeEngine
from vllm_moa.decoding.results import summarize  # noqa: E402
from vllm_moa.decoding.retrieval import Retrieval  # noqa: E402
from vllm_moa.decoding.tree import DraftSpec  # noqa: E402
from vllm_moa.models import load_drafter  # noqa: E402
from vllm_moa.packed_linear import weight_format  # noqa: E402
from vllm_moa.shipped import SHIPPED_SMOLLM2  # noqa: E402
from vllm_moa.target import TargetModel  # noqa: E402
from vllm_moa.targets import fetch_smollm2  # noqa: E402
from vllm_moa.training.data import read_prompts  # noqa: E402

SHAPES = {"chain K=3": DraftSpec.chain(3), "tree 3,2,4": DraftSpec.tree(3, 2, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, default=None,
                        help="a Spec-Bench question.jsonl (default: the shipped drafters' held-out prompts)")
    parser.add_argument("--prompt-tokens", type=int, default=192, help="keep the last N prompt tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--drafters", nargs="+", default=["moa-tli0", "hybrid:moa-tli0", "ngram"],
                        help="shipped drafter names, 'ngram', 'hybrid:<name>' (lookup merged into its drafts), "
                             "'int8:<name>' / 'bf16:<name>' (also 'hybrid:int8:<name>'): on int8 / bf16 weights")
    parser.add_argument("--repeats", type=int, default=2,
                        help="plain/speculative pairs per configuration (even: as many with either first)")
    parser.add_argument("--adaptive", action="store_true", help="each configuration also with adaptive=True")
    parser.add_argument("--control", action="store_true",
                        help="per batch size, also a plain engine paired with plain decoding (the noise floor)")
    parser.add_argument("--sequential-drafting", action="store_true",
                        help="also rows with batch_drafting=False for drafters that draft together, at batch > 1")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "runtime_batch_cpu_smollm2.json")
    args = parser.parse_args()
    prov = provenance(torch_threads=torch.get_num_threads())  # at start: the code that runs
    target_dir = fetch_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = TargetModel.from_pretrained(target_dir)
    if args.prompts is None:
        heldout = json.loads((SHIPPED_SMOLLM2 / "heldout_prompts.json").read_text())
        texts = [p if isinstance(p, str) else p["text"] for p in heldout]
    else:
        texts = read_prompts(args.prompts)
    texts = texts[: max(args.batches)]  # batch b takes the first b, cycled
    prompts = [encode_prompt(tokenizer, t)[-args.prompt_tokens :] for t in texts]
    loaded = {}
    for name in args.drafters:
        base = name.removeprefix("hybrid:")  # "int8:moa-tli0": that drafter on int8 weights
        if base not in loaded:
            fmt, _, shipped = base.rpartition(":")
            loaded[base] = "ngram" if base == "ngram" else load_drafter(SHIPPED_SMOLLM2 / shipped, target).eval()
            if fmt:
                weight_format(loaded[base], fmt)
    plain_engine = SpeculativeEngine(target, None)
    plain_engine.generate([prompts[0]], 8)  # warm-up
    rows = []
    for batch in args.batches:
        ids = [prompts[i % len(prompts)] for i in range(batch)]
        for name in tqdm((["none (control)"] if args.control else []) + args.drafters, desc=f"batch {batch}"):
            drafter = None if name == "none (control)" else loaded[name.removeprefix("hybrid:")]
            retrieval = Retrieval() if name.startswith("hybrid:") else None
            variants = [(a, True) for a in ((False, True) if args.adaptive and drafter is not None else (False,))]
            if args.sequential_drafting and batch > 1 and SpeculativeEngine(target, drafter, retrieval=retrieval).drafts_together:
                variants.append((False, False))
            shapes = SHAPES if drafter is not None else {"plain": DraftSpec.chain(1)}
            for (shape_name, spec), (adaptive, together) in ((shape, v) for shape in shapes.items() for v in variants):
                engine = SpeculativeEngine(target, drafter, spec, retrieval=retrieval, adaptive=adaptive,
                                           batch_drafting=together)
                shape_name = f"{shape_name}, adaptive" if adaptive else shape_name
                engine.generate([ids[0]], 4)  # warm-up
                plain_s = spec_s = 0.0
                results, ties, ratios = [], [], []
                for repeat in range(args.repeats):
                    # order-balanced pairs: the run second in a pair reads up to 5-10% off the first
                    # on this machine (by engine, not by kind), so every other pair runs it first
                    plain, plain_took, out, spec_took = _pair(plain_engine, engine, ids, args.max_new_tokens,
                                                              speculative_first=repeat % 2 == 1)
                    plain_s, spec_s = plain_s + plain_took, spec_s + spec_took
                    ratios.append(round(plain_took / spec_took, 3))
                    for prompt, p, o in zip(ids, plain, out):
                        if o.token_ids != p.token_ids:
                            ties.append(_float_tie(target, prompt, p.token_ids, o.token_ids,
                                                   f"{name} {shape_name} batch {batch}"))
                    results += out
                tokens = sum(len(r.token_ids) for r in results)
                summary = summarize(results, spec_s, spec.depth)
                rows.append({
                    "batch": batch, "drafter": name, "draft": shape_name,
                    "drafting": "together" if engine.drafts_together else "one by one",
                    "acceptance_length": round(summary["acceptance_length"], 3),
                    "tokens_per_s": round(tokens / spec_s, 1), "plain_tokens_per_s": round(tokens / plain_s, 1),
                    "speedup": round(plain_s / spec_s, 3), "speedup_per_repeat": ratios,
                    "drafter_share": round(summary["drafter_share"], 3),
                    "plain_round_share": round(sum(d == 0 for r in results for d in r.drafted_per_forward)
                                               / max(1, sum(len(r.drafted_per_forward) for r in results)), 3),
                    "outputs_equal_to_plain": len(results) - len(ties), "float_ties": ties,
                })
                print(rows[-1])
        _write(args, rows, prov)  # after every batch size: a run cut short keeps what it measured


def _pair(plain_engine: SpeculativeEngine, engine: SpeculativeEngine, ids: list[list[int]], max_new_tokens: int,
          speculative_first: bool) -> tuple[list, float, list, float]:
    """One plain and one speculative run of the batch, in the order asked: (plain outputs, plain
    seconds, speculative outputs, speculative seconds)."""
    took = {}
    for which in (("speculative", "plain") if speculative_first else ("plain", "speculative")):
        started = time.perf_counter()
        outputs = (plain_engine if which == "plain" else engine).generate(ids, max_new_tokens)
        took[which] = outputs, time.perf_counter() - started
    return (*took["plain"], *took["speculative"])


TIE_MARGIN = 1e-3  # logits this close: the batched and the plain forward may order them differently


def _float_tie(target: TargetModel, prompt: list[int], plain: list[int], spec: list[int], what: str) -> dict:
    """Where a speculative output leaves plain decoding's: allowed only at a float tie of the
    target's two best logits (fp32 forwards over different shapes round differently), else an error."""
    at = next(i for i, (a, b) in enumerate(zip(plain, spec)) if a != b)
    with torch.no_grad():
        logits = target(torch.tensor([prompt + plain[:at]])).logits[0, -1]
    top = logits.topk(2)
    margin = float(top.values[0] - top.values[1])
    if margin >= TIE_MARGIN or set(top.indices.tolist()) != {plain[at], spec[at]}:
        raise AssertionError(f"{what}: output differs from plain at token {at} (logit margin {margin:.2e})")
    return {"token": at, "plain": plain[at], "speculative": spec[at], "logit_margin": margin}


def _write(args: argparse.Namespace, rows: list[dict], prov: dict) -> None:
    report = {
        "benchmark": "runtime_batch_cpu", "target": "SmolLM2-135M-Instruct (fp32)",
        "prompts": "heldout" if args.prompts is None else str(args.prompts.parent.name),
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "pairs": "order-balanced: plain first in even repeats, speculative first in odd ones",
        "decoding": f"greedy; every output equal to plain batched decoding, or left at a float tie (the target's "
                    f"two best logits within {TIE_MARGIN}: rows' float_ties)",
        "drafting": "'together': one drafter forward per tree level for the batch (decoding/drafters.propose_all); "
                    "'one by one': a drafter call per sequence and level",
        "rows": rows, "provenance": prov,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(report: dict, path: Path) -> None:
    """Tokens/s against batch size (plain decoding: the mean of the paired plain runs) and the speedup."""
    fig, (ax_rate, ax_speed) = plt.subplots(1, 2, figsize=(13, 4.8))
    rows = report["rows"]
    batches = sorted({r["batch"] for r in rows})
    plain = [sum(r["plain_tokens_per_s"] for r in rows if r["batch"] == b) / sum(r["batch"] == b for r in rows)
             for b in batches]
    ax_rate.plot(batches, plain, "s-", color="black", label="plain decoding (none)")
    families = sorted({(r["drafter"], r["draft"].removesuffix(", adaptive")) for r in rows})
    colors = dict(zip(families, plt.cm.tab10.colors * 3))  # one color per drafter and shape
    for drafter, draft, drafting in sorted({(r["drafter"], r["draft"], r["drafting"]) for r in rows}):
        sel = [r for r in rows if (r["drafter"], r["draft"], r["drafting"]) == (drafter, draft, drafting)]
        one_by_one = drafting == "one by one" and drafter not in ("ngram", "none (control)")
        label = f"{drafter}, {draft}" + (", one by one" if one_by_one else "")
        style = ":" if one_by_one else "--" if "adaptive" in draft else "-"
        for ax, key in ((ax_rate, "tokens_per_s"), (ax_speed, "speedup")):
            ax.plot([r["batch"] for r in sel], [r[key] for r in sel], style, marker="o", label=label,
                    color=colors[(drafter, draft.removesuffix(", adaptive"))])
    ax_speed.axhline(1.0, color="black", linewidth=0.8)
    for ax, ylabel in ((ax_rate, "tokens / s (all sequences)"), (ax_speed, "speedup over plain batched decoding")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size (sequences decoded together)")
        ax.set_ylabel(ylabel)
    ax_speed.legend(fontsize=6, ncol=2)
    prov = report["provenance"]
    fig.suptitle(f"SmolLM2, {report['prompts']} prompts x {report['max_new_tokens']} tokens, greedy - {prov['cpu']}, "
                 f"{prov['torch_threads']} threads, commit {prov['commit'][:8]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
