"""Greedy MoA speculative decoding through the Python API, on the shipped demo models
(vllm_moa/assets/demo) or on your own target + drafter directories.

    python examples/speculative_generate.py
    python examples/speculative_generate.py --target path/to/target --drafter runs/moa/drafter
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import AutoTokenizer

from vllm_moa.decoding.chain import plain_greedy_generate, speculative_greedy_generate
from vllm_moa.models import load_drafter
from vllm_moa.target import TargetModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, help="target directory (default: the shipped demo target)")
    parser.add_argument("--drafter", type=Path, help="drafter directory (default: the shipped demo MoA TLI=0)")
    parser.add_argument("--prompt", default="def read_config(path):\n    \"\"\"Read a config file.\"\"\"\n")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--num-draft", type=int, default=4)
    args = parser.parse_args()
    if args.target is None or args.drafter is None:
        from vllm_moa.shipped import SHIPPED

        args.target, args.drafter = args.target or SHIPPED / "target", args.drafter or SHIPPED / "moa-tli0"
    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    target = TargetModel.from_pretrained(args.target)
    drafter = load_drafter(args.drafter, target, strict_fingerprint=False).eval()
    prompt_ids = tokenizer(args.prompt)["input_ids"]
    spec = speculative_greedy_generate(target, drafter, prompt_ids, args.max_new_tokens, num_draft=args.num_draft)
    plain = plain_greedy_generate(target, prompt_ids, args.max_new_tokens)
    assert spec.token_ids == plain.token_ids
    print(args.prompt + tokenizer.decode(spec.token_ids))
    print(f"\nacceptance length {spec.acceptance_length:.2f}, speedup {plain.seconds / spec.seconds:.2f}x")


if __name__ == "__main__":
    main()
