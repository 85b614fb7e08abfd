"""The demo models: a demo target, its shipped MoA drafter and held-out prompts.

* "smollm2" (default): the real SmolLM2-135M-Instruct, fetched and converted once through pip
  (vllm_moa.targets), with the MoA drafter shipped in vllm_moa/assets/smollm2 (built by
  vllm_moa/recipes/smollm2.py); it answers a held-out chat prompt through the chat template.
* "stdlib": the small Llama trained on this Python's standard library and its drafters, shipped
  in vllm_moa/assets/demo (built by vllm_moa/recipes/stdlib_demo.py): fast, for tests.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_moa.shipped import MOA_DRAFTERS, SHIPPED, SHIPPED_SMOLLM2

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


def encode_demo_prompt(tokenizer, prompt: str, target: str) -> list[int]:
    """Token ids of a demo prompt: the instruct target answers through its chat template, the
    stdlib target continues code."""
    from vllm_moa.chat import encode_prompt

    ids = encode_prompt(tokenizer, prompt, chat=bool(prompt) and target == "smollm2")
    if not ids:
        raise ValueError("prompt is empty after tokenisation")
    return ids
