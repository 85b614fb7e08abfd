"""The embedded default, `vllm-moa demo`: MoA speculative decoding on CPU, checked token for token
against plain greedy decoding, with its acceptance length and speedup.

Two targets:
* "smollm2" (default): the real SmolLM2-135M-Instruct, fetched and converted once through pip
  (vllm_moa.targets), with the MoA drafter shipped in vllm_moa/assets/smollm2 (built by
  vllm_moa/recipes/smollm2.py); it answers a held-out chat prompt through the chat template.
* "stdlib": the small Llama trained on this Python's standard library and its drafters, shipped
  in vllm_moa/assets/demo (built by vllm_moa/recipes/stdlib_demo.py): fast, for tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_moa.shipped import MOA_DRAFTERS, SHIPPED, SHIPPED_SMOLLM2

if TYPE_CHECKING:
    from vllm_moa.decoding.tree import DraftSpec

DEMO_TARGETS = ("smollm2", "stdlib")


def demo_models(drafter: str = "moa-tli0", target: str = "stdlib") -> tuple[Path, Path, list[str]]:
    """(target dir, drafter dir, held-out prompts) of a demo target and its shipped MoA drafter."""
    if target not in DEMO_TARGETS:
        raise ValueError(f"target must be one of {', '.join(DEMO_TARGETS)}, got {target!r}")
    if drafter not in MOA_DRAFTERS:
        raise ValueError(f"drafter must be one of {', '.join(MOA_DRAFTERS)}, got {drafter!r}")
    if target == "smollm2":
        if not (SHIPPED_SMOLLM2 / drafter / "model.safetensors").is_file():
            shipped = sorted(d.name for d in SHIPPED_SMOLLM2.iterdir() if d.is_dir()) if SHIPPED_SMOLLM2.is_dir() else []
            raise FileNotFoundError(f"no shipped SmolLM2 drafter {drafter!r} (shipped: {', '.join(shipped) or 'none'}); "
                                    "build it with `python -m vllm_moa.recipes.smollm2 --ship vllm_moa/assets/smollm2`")
        from vllm_moa.targets import fetch_smollm2

        prompts = json.loads((SHIPPED_SMOLLM2 / "heldout_prompts.json").read_text())
        return fetch_smollm2(), SHIPPED_SMOLLM2 / drafter, prompts
    if not (SHIPPED / "target" / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"no demo models in {SHIPPED}: build them with `python -m vllm_moa.recipes.stdlib_demo --ship {SHIPPED}`"
        )
    prompts = [p["text"] for p in json.loads((SHIPPED / "heldout_prompts.json").read_text())]
    return SHIPPED / "target", SHIPPED / drafter, prompts


def run_demo(max_new_tokens: int = 128, spec: DraftSpec | None = None, prompt: str | None = None,
             drafter: str = "moa-tli0", repeats: int = 3, target: str = "smollm2",
             drafter_weights: str = "auto") -> dict:
    """Generate with MoA speculative decoding (default: decoding.tree.DEFAULT_TREE, an EAGLE-2 tree) and with
    plain decoding; return what was measured."""
    from transformers import AutoTokenizer

    from vllm_moa.decoding.chain import plain_greedy_generate
    from vllm_moa.decoding.engine import SpeculativeEngine
    from vllm_moa.decoding.tree import DEFAULT_TREE
    from vllm_moa.kinds.moa import MoADrafter
    from vllm_moa.packed_linear import check_drafter_weights, marked_format, weight_format
    from vllm_moa.target import TargetModel
    from vllm_moa.training.data import encode_prompt

    check_drafter_weights(drafter_weights, "--drafter-weights")  # refused before anything loads
    target_name = target
    target_dir, drafter_dir, prompts = demo_models(drafter, target)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = TargetModel.from_pretrained(target_dir)
    target.name = json.loads((drafter_dir / "config.json").read_text())["target"]["name"]
    model = weight_format(MoADrafter.from_pretrained(drafter_dir, target).eval(), drafter_weights)
    spec = spec or DEFAULT_TREE
    prompt = prompt if prompt is not None else prompts[0]
    # the instruct target answers through its chat template; the stdlib target continues code
    prompt_ids = encode_prompt(tokenizer, prompt) if prompt and target_name == "smollm2" else tokenizer(prompt)["input_ids"]
    if not prompt_ids:
        raise ValueError("prompt is empty after tokenisation")
    engine = SpeculativeEngine(target, model, spec)
    engine.check_request([prompt_ids], [max_new_tokens], None)  # refuse bad input before the warm-up and timing
    plain_greedy_generate(target, prompt_ids, 8)  # warm-up
    # alternate the two and keep the best time of each: robust to other load on the machine
    plains, runs = [], []
    for _ in range(repeats):
        plains.append(plain_greedy_generate(target, prompt_ids, max_new_tokens))
        runs.append(engine.generate([prompt_ids], max_new_tokens)[0])
    plain = min(plains, key=lambda r: r.seconds)
    best = min(runs, key=lambda r: r.seconds)
    if best.token_ids != plain.token_ids:
        raise AssertionError("speculative output differs from greedy decoding: this is a bug, please report it")
    return {
        "prompt": prompt,
        "text": tokenizer.decode(best.token_ids),
        "new_tokens": len(best.token_ids),
        "acceptance_length": best.acceptance_length,
        "draft": spec.describe(),
        "drafter": drafter,
        "drafter_weights": marked_format((model,)),
        "target": target_name,
        "speculative_tokens_per_s": best.tokens_per_second,
        "plain_tokens_per_s": plain.tokens_per_second,
        "speedup": plain.seconds / best.seconds,
        "drafter_time_share": best.drafter_seconds / best.seconds,
        "models": str(drafter_dir.parent),
        "target_dir": str(target_dir),
    }
