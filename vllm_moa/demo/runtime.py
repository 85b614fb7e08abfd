"""`vllm-moa demo --engine runtime`: MoA speculative decoding through the transformers runtime on
CPU (decoding/), lookup merged into its drafts unless turned off, checked token for token against
plain greedy decoding, with its acceptance length and speedup.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from vllm_moa.demo.models import demo_models, encode_demo_prompt

if TYPE_CHECKING:
    from vllm_moa.decoding.retrieval import Retrieval
    from vllm_moa.decoding.tree import DraftSpec


def run_demo(max_new_tokens: int = 128, spec: DraftSpec | None = None, prompt: str | None = None,
             drafter: str = "moa-tli0", repeats: int = 3, target: str = "smollm2",
             drafter_weights: str = "auto", lookup: bool | Retrieval = True) -> dict:
    """Generate with MoA speculative decoding (default: decoding.tree.DEFAULT_TREE, an EAGLE-2 tree,
    with lookup merged in: decoding.retrieval.lookup_options) and with plain decoding; return what
    was measured."""
    from transformers import AutoTokenizer

    from vllm_moa.decoding.chain import plain_greedy_generate
    from vllm_moa.decoding.engine import SpeculativeEngine
    from vllm_moa.decoding.retrieval import lookup_options
    from vllm_moa.decoding.tree import DEFAULT_TREE
    from vllm_moa.kinds.moa import MoADrafter
    from vllm_moa.packed_linear import check_drafter_weights, marked_format, weight_format
    from vllm_moa.target import TargetModel

    check_drafter_weights(drafter_weights, "--drafter-weights")  # refused before anything loads
    target_name = target
    target_dir, drafter_dir, prompts = demo_models(drafter, target)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = TargetModel.from_pretrained(target_dir)
    target.name = json.loads((drafter_dir / "config.json").read_text())["target"]["name"]
    model = weight_format(MoADrafter.from_pretrained(drafter_dir, target).eval(), drafter_weights)
    spec = spec or DEFAULT_TREE
    prompt = prompt if prompt is not None else prompts[0]
    prompt_ids = encode_demo_prompt(tokenizer, prompt, target_name)
    retrieval = lookup_options(lookup, model_free=False)
    engine = SpeculativeEngine(target, model, spec, retrieval=retrieval)
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
        "draft": spec.describe() + (" + lookup" if retrieval is not None else ""),
        "engine": "runtime",
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
