"""Offline generation with vLLM and the MoA drafter (speculative method "moa").

Needs a GPU and vLLM 0.26 (pip install 'vllm-moa[vllm]'); the plugin is found through its entry
point, nothing to import. Defaults: the shipped demo target and its TLI = 0 MoA drafter, the
held-out stdlib prompts. Prints the texts, vLLM's spec-decode counters (mean acceptance length =
1 + accepted / drafts, and per position) and, with --check, whether greedy output equals vLLM
without speculation token for token.

    python examples/offline_inference.py
    python examples/offline_inference.py --target path/to/llama --drafter runs/moa/drafter -k 5
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "vllm_moa" / "assets" / "demo"


def spec_decode_counters(metrics) -> dict:
    """vLLM's spec-decode metrics (LLM.get_metrics(), needs disable_log_stats=False)."""
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict = {}
    for metric in metrics:
        if metric.name == "vllm:spec_decode_num_drafts" and isinstance(metric, Counter):
            out["drafts"] = out.get("drafts", 0) + metric.value
        elif metric.name == "vllm:spec_decode_num_draft_tokens" and isinstance(metric, Counter):
            out["draft_tokens"] = out.get("draft_tokens", 0) + metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens" and isinstance(metric, Counter):
            out["accepted"] = out.get("accepted", 0) + metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos" and isinstance(metric, Vector):
            per_pos = out.setdefault("accepted_per_pos", [0] * len(metric.values))
            for i, value in enumerate(metric.values):
                per_pos[i] += value
    if out.get("drafts"):
        out["mean_acceptance_length"] = 1 + out["accepted"] / out["drafts"]
        out["acceptance_rate_per_pos"] = [v / out["drafts"] for v in out.get("accepted_per_pos", [])]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(DEMO / "target"))
    parser.add_argument("--drafter", default=str(DEMO / "moa-tli0"))
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16, help="how many held-out demo prompts")
    parser.add_argument("--prompt", action="append", help="your own prompt (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / compilation")
    parser.add_argument("--check", action="store_true", help="also run without speculation and compare")
    parser.add_argument("--json", type=Path, help="write results here")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    prompts = args.prompt or [p["text"] for p in json.loads((DEMO / "heldout_prompts.json").read_text())]
    prompts = prompts[: args.prompts] if not args.prompt else prompts
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    common = dict(model=args.target, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                  gpu_memory_utilization=args.gpu_memory_utilization, disable_log_stats=False)

    llm = LLM(**common, speculative_config={"method": "moa", "model": args.drafter,
                                            "num_speculative_tokens": args.num_speculative_tokens})
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    counters = spec_decode_counters(llm.get_metrics())
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    for out in outputs[:3]:
        print(f"--- {out.prompt[-60:]!r}\n{out.outputs[0].text}")
    result = {"target": args.target, "drafter": args.drafter, "k": args.num_speculative_tokens,
              "prompts": len(prompts), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
              **counters}

    if args.check:
        del llm
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
        plain = LLM(**common)
        start = time.perf_counter()
        reference = plain.generate(prompts, sampling)
        plain_seconds = time.perf_counter() - start
        same = [list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids) for a, b in zip(outputs, reference)]
        result.update(plain_seconds=plain_seconds, speedup=plain_seconds / seconds,
                      identical_outputs=sum(same), compared=len(same))
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
