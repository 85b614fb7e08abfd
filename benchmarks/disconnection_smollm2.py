"""After the server is gone: how well each SmolLM2 drafter keeps writing alone.

    python -m benchmarks.disconnection_smollm2 --specbench ../shared/data/specbench \
        [--num-prompts 8] [--cuts 16 64] [--offline 256] [--windows 256]

The client-server client keeps generating when its server is unreachable: its drafter extends the
unverified chain alone (`serving/local.py: LocalDrafting.draft_ahead`, what `RemoteDraftingClient`
runs offline) until the link returns and the target confirms the longest prefix it agrees with.
The paper's claim: MoA keeps a higher accuracy alone than other drafters. Here, per prompt, the
target (SmolLM2-135M-Instruct, fp32) answers greedily; after `cut` of its tokens (16 or 64) the
link is gone: each drafter's client session starts from the server's view of the prompt and those
tokens (the sync payload the server would send: `kinds/<kind>/sync.server_sync`, encoded fp16 and
decoded by the client's `decode_sync`, as over HTTP) and drafts `--offline` tokens alone, greedily.

Per drafter, over the first 16 / 64 / 256 offline tokens:
* exact prefix: how many of them equal the target's own greedy continuation before the first
  difference (what the target confirms at resync);
* target picks: the share of them the target itself would choose after the offline text before
  them (its argmax at each position of prompt + verified + offline text);
* target NLL: the target's mean negative log-likelihood per token of what the drafter wrote (the
  target's own greedy continuation's NLL is listed as the floor).
* distinct 4-grams: the share of the written text's 4-grams that are distinct (a drafter caught in
  a loop writes text the target, reading the loop, comes to pick and finds likely: this tells
  such text from good text; the target's own continuation gives the reference).
A token not written (n-gram lookup stops where the text holds no match) counts as not picked and
ends the prefix; the NLL and the 4-grams are over the tokens written.
Drafters: the shipped MoA (TLI 0; `--windows`: the same with attention_window set, trained
without one), EAGLE-style, n-gram lookup over the prompt and verified text. SmolLM2 has no smaller
sibling offline, so no independent small LM is listed. Prompts: Spec-Bench mt_bench first turns
(writing, humanities, coding; evaluation only, read from the path given), chat-templated.
JSON + PNG in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from benchmarks.long_generation_acceptance import read_questions  # noqa: E402
from benchmarks.provenance import ROOT, provenance  # noqa: E402
from vllm_moa import registry as kinds  # noqa: E402
from vllm_moa.chat import encode_prompt  # noqa: E402
from vllm_moa.decoding.engine import SpeculativeEngine  # noqa: E402
from vllm_moa.models import load_drafter  # noqa: E402
from vllm_moa.serving.local import decode_sync, open_local  # noqa: E402
from vllm_moa.serving.protocol import SyncPayload  # noqa: E402
from vllm_moa.shipped import SHIPPED_SMOLLM2  # noqa: E402
from vllm_moa.target import TargetModel, TargetOutput  # noqa: E402
from vllm_moa.targets import fetch_smollm2  # noqa: E402

HORIZONS = (16, 64, 256)
ENCODING = "fp16"


def server_view(drafter, target: TargetModel, out: TargetOutput, count: int):
    """What the server would send a client that opened on `count` tokens (`out`: the target's
    output over them): the sync payload of its kind (its server_sync, fp16 on the wire), decoded as
    the client decodes it."""
    payload = SyncPayload(start=0, count=count)
    kind = kinds.kind_of(kinds.as_drafter(drafter))
    if kind.server_sync is not None:
        # the server's copy of the drafter's shared weights (MoA's LSA; the others need none)
        kind.server_sync(payload, out, torch.arange(count), ENCODING, drafter if kind.name == "moa" else None)
    return decode_sync(payload, torch.float32, torch.device("cpu"), target.signature)


def offline_continuation(drafter, target: TargetModel, verified: list[int], out: TargetOutput, pending: int,
                         n: int) -> list[int]:
    """The client's drafter alone after `verified` tokens (prompt + answer so far; `out`: the
    target's output over them; the last sampled token `pending` not yet run through the target):
    n tokens, greedy."""
    session = open_local(drafter, target)
    session.start(verified, server_view(drafter, target, out, len(verified)))
    with torch.no_grad():
        return session.draft_ahead([pending], n)


def judge(target: TargetModel, context: list[int], written: list[int], reference: list[int]) -> dict:
    """The target's verdict on `written` after `context` (its greedy continuation: `reference`)."""
    picks, nll = [], []
    if written:  # n-gram lookup writes nothing where the text holds no match
        with torch.no_grad():
            logits = target(torch.tensor([context + written])).logits[0, len(context) - 1 : -1].float()
        tokens = torch.tensor(written)
        picks = (logits.argmax(-1) == tokens).tolist()
        nll = (-torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]).tolist()
    row = {}
    for h in HORIZONS:
        prefix = 0
        while prefix < min(h, len(written)) and written[prefix] == reference[prefix]:
            prefix += 1
        row[f"prefix_{h}"] = prefix
        row[f"target_picks_{h}"] = round(sum(picks[:h]) / h, 4)  # a token not written is not picked
        row[f"target_nll_{h}"] = round(statistics.mean(nll[:h]), 4) if nll else None  # over what was written
        row[f"distinct_4grams_{h}"] = distinct_ngrams(written[:h], 4)
    return row


def distinct_ngrams(tokens: list[int], n: int) -> float | None:
    """The share of a text's n-grams that are distinct: 1.0 for text that never repeats itself,
    near 0 for a loop (which the target, reading the loop, also comes to pick)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return round(len(set(grams)) / len(grams), 4) if grams else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specbench", type=Path, required=True, help="folder with mt_bench/question.jsonl")
    parser.add_argument("--categories", nargs="+", default=["writing", "humanities", "coding"])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--cuts", type=int, nargs="+", default=[16, 64], help="verified answer tokens before the cut")
    parser.add_argument("--offline", type=int, default=256, help="tokens each drafter writes alone")
    parser.add_argument("--windows", type=int, nargs="*", default=[], help="MoA also with these attention windows")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "disconnection_smollm2.json")
    args = parser.parse_args()

    origin = provenance(torch_threads=torch.get_num_threads())
    folder = fetch_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    target = TargetModel.from_pretrained(folder).eval()
    per_category = -(-args.num_prompts // len(args.categories))
    texts = [t for c in args.categories for t in read_questions(args.specbench / "mt_bench" / "question.jsonl", [c],
                                                                 per_category)][: args.num_prompts]
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    drafters = {"moa-tli0": load_drafter(SHIPPED_SMOLLM2 / "moa-tli0", target).eval()}
    for window in args.windows:
        drafters[f"moa-tli0 W={window}"] = load_drafter(SHIPPED_SMOLLM2 / "moa-tli0", target).eval()
        drafters[f"moa-tli0 W={window}"].attention_window = window
    drafters["eagle"] = load_drafter(SHIPPED_SMOLLM2 / "eagle", target).eval()
    drafters["ngram"] = "ngram"

    started = time.time()
    total = max(args.cuts) + args.offline
    answers = [r.token_ids for r in SpeculativeEngine(target, None).generate(prompts, total)]
    rows = []
    for cut in args.cuts:
        for i, (prompt, answer) in enumerate(tqdm(list(zip(prompts, answers)), desc=f"cut at {cut}")):
            verified, pending, reference = prompt + answer[: cut - 1], answer[cut - 1], answer[cut:]
            # the target's own continuation, judged the same way: the floor of the NLL
            rows.append({"drafter": "target (greedy)", "cut": cut, "prompt": i,
                         **judge(target, verified + [pending], reference[: args.offline], reference)})
            with torch.no_grad():  # once for every drafter: the server's forward over the verified tokens
                out = target(torch.tensor([verified]))
            for name, drafter in drafters.items():
                written = offline_continuation(drafter, target, verified, out, pending, args.offline)
                rows.append({"drafter": name, "cut": cut, "prompt": i, "offline_tokens": len(written),
                             **judge(target, verified + [pending], written, reference)})
    summary = {}
    for cut in args.cuts:
        for name in ["target (greedy)", *drafters]:
            sel = [r for r in rows if r["cut"] == cut and r["drafter"] == name]
            summary[f"{name}/cut={cut}"] = {
                key: round(statistics.mean(r[key] for r in sel if r[key] is not None), 3)
                if any(r[key] is not None for r in sel) else None
                for key in sel[0] if key.split("_")[0] in ("prefix", "target", "offline", "distinct")}
            print(f"cut {cut:3d} {name:18s} " + " ".join(f"{k} {v}" for k, v in summary[f"{name}/cut={cut}"].items()),
                  flush=True)
    report = {
        "benchmark": "disconnection_smollm2", "target": "SmolLM2-135M-Instruct (vllm-moa fetch smollm2, fp32)",
        "prompts": {"set": "Spec-Bench mt_bench, first turn", "categories": args.categories, "count": len(prompts),
                    "prompt_tokens": [len(p) for p in prompts]},
        "cuts": args.cuts, "offline_tokens": args.offline, "horizons": HORIZONS, "sync_encoding": ENCODING,
        "drafters": {"moa-tli0": "vllm_moa/assets/smollm2/moa-tli0", "eagle": "vllm_moa/assets/smollm2/eagle",
                     "ngram": "lookup over prompt + verified text", "windows": args.windows},
        "method": "the client session's draft_ahead from the server's sync view (fp16), greedy; judged by one target "
                  "forward over prompt + verified + offline text",
        "summary": summary, "rows": rows, "wall_time_s": round(time.time() - started, 1), "provenance": origin,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(report: dict, path: Path) -> None:
    names = list(dict.fromkeys(key.split("/cut=")[0] for key in report["summary"]))
    metrics = (("prefix", "exact prefix (tokens)"), ("target_picks", "share the target would pick"),
               ("target_nll", "target NLL per token"), ("distinct_4grams", "distinct 4-grams (share)"))
    fig, axes = plt.subplots(len(report["cuts"]), len(metrics), figsize=(20, 3.8 * len(report["cuts"])), squeeze=False)
    for r, cut in enumerate(report["cuts"]):
        for c, (metric, label) in enumerate(metrics):
            ax = axes[r, c]
            for j, name in enumerate(names):
                stats = report["summary"][f"{name}/cut={cut}"]
                ax.plot(HORIZONS, [stats[f"{metric}_{h}"] if stats[f"{metric}_{h}"] is not None else float("nan")
                                   for h in HORIZONS], marker="o", color=f"C{j}", label=name,
                        linestyle="--" if name.startswith("target") else "-")
            ax.set_xscale("log", base=2)
            ax.set_xticks(HORIZONS, [str(h) for h in HORIZONS])
            ax.set_xlabel("offline tokens judged (first n)")
            ax.set_title(f"cut after {cut} verified tokens: {label}", fontsize=9)
            ax.legend(fontsize=7)
    prov = report["provenance"]
    fig.suptitle(f"SmolLM2-135M-Instruct: drafters writing alone after a disconnection, {report['prompts']['count']} "
                 f"mt_bench prompts - commit {prov['commit'][:8]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
