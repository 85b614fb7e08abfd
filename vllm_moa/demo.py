"""The embedded default: a small Llama target trained on this Python's standard library, and its
MoA drafters trained on the target's own continuations.

`vllm-moa demo` uses the models shipped in vllm_moa/assets/demo (built by
vllm_moa/recipes/stdlib_demo.py). It generates from a held-out stdlib
prompt with MoA speculative decoding and with plain decoding, checks that both agree token for
token, and reports the acceptance length and the speedup.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_moa.decoding.tree import DraftSpec

SHIPPED = Path(__file__).parent / "assets" / "demo"


MOA_DRAFTERS = ("moa-tli0", "moa-tli1")
SHIPPED_DRAFTERS = (*MOA_DRAFTERS, "eagle", "independent")


def drafter_directory(spec: str | Path) -> Path:
    """A drafter directory given as a path or as the name of a shipped demo drafter."""
    if Path(spec).is_dir():
        return Path(spec)
    if str(spec) in SHIPPED_DRAFTERS:
        return SHIPPED / str(spec)
    raise FileNotFoundError(f"drafter {str(spec)!r} is neither a directory nor a shipped demo drafter "
                            f"({', '.join(SHIPPED_DRAFTERS)})")


def demo_models(drafter: str = "moa-tli0") -> tuple[Path, Path, list[str]]:
    """(target dir, drafter dir, held-out prompts) of the shipped demo models."""
    if not (SHIPPED / "target" / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"no demo models in {SHIPPED}: build them with `python -m vllm_moa.recipes.stdlib_demo --ship {SHIPPED}`"
        )
    if drafter not in MOA_DRAFTERS:
        raise ValueError(f"drafter must be one of {', '.join(MOA_DRAFTERS)}, got {drafter!r}")
    prompts = [p["text"] for p in json.loads((SHIPPED / "heldout_prompts.json").read_text())]
    return SHIPPED / "target", SHIPPED / drafter, prompts


def run_demo(max_new_tokens: int = 128, spec: DraftSpec | None = None, prompt: str | None = None,
             drafter: str = "moa-tli0", repeats: int = 3) -> dict:
    """Generate with MoA speculative decoding (default: the EAGLE-2 tree of vllm_moa.api) and with
    plain decoding; return what was measured."""
    from transformers import AutoTokenizer

    from vllm_moa.api import DEFAULT_TREE
    from vllm_moa.decoding.chain import plain_greedy_generate
    from vllm_moa.decoding.engine import SpeculativeEngine
    from vllm_moa.models import MoADrafter
    from vllm_moa.target import TargetModel

    target_dir, drafter_dir, prompts = demo_models(drafter)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = TargetModel.from_pretrained(target_dir)
    target.name = json.loads((drafter_dir / "config.json").read_text())["target"]["name"]
    model = MoADrafter.from_pretrained(drafter_dir, target).eval()
    spec = spec or DEFAULT_TREE
    prompt = prompt if prompt is not None else prompts[0]
    prompt_ids = tokenizer(prompt)["input_ids"]
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
        "speculative_tokens_per_s": best.tokens_per_second,
        "plain_tokens_per_s": plain.tokens_per_second,
        "speedup": plain.seconds / best.seconds,
        "drafter_time_share": best.drafter_seconds / best.seconds,
        "models": str(target_dir.parent),
    }
