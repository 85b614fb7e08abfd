"""Batch-1 entry points: plain decoding (the baseline every speedup is measured against: one
target forward per token, same functional target, no engine bookkeeping) and single-prompt
speculative decoding through the engine (decoding/engine.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from vllm_moa.decoding.engine import SpeculativeEngine
from vllm_moa.decoding.results import GenerationResult
from vllm_moa.decoding.sampling import SamplingParams, make_generator, pick
from vllm_moa.decoding.tree import DraftSpec
from vllm_moa.registry import DrafterArg
from vllm_moa.target import TargetKVCache, TargetModel


def _check_request(prompt_ids: list[int], max_new_tokens: int, num_draft: int | None = None) -> None:
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: give at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if num_draft is not None and num_draft <= 0:
        raise ValueError(f"num_draft must be > 0, got {num_draft}")


@torch.no_grad()
def plain_generate(target: TargetModel, prompt_ids: list[int], max_new_tokens: int,
                   sampling: SamplingParams | None = None, seed: int | None = None,
                   eos_token_id: int | None = None) -> GenerationResult:
    """The baseline: one target forward per token, same functional target and cache."""
    _check_request(prompt_ids, max_new_tokens)
    generator = make_generator(seed, target.device)
    started = time.perf_counter()
    cache = TargetKVCache()
    logits = target(torch.tensor([prompt_ids], device=target.device), cache).logits
    tokens: list[int] = []
    result = GenerationResult(tokens)
    while True:
        token = pick(logits[:, -1], sampling, generator)
        tokens.append(int(token))
        if len(tokens) >= max_new_tokens or int(token) == eos_token_id:
            break
        logits = target(token, cache).logits
        result.target_forwards += 1
        result.accepted_per_forward.append(1)
    result.seconds = time.perf_counter() - started
    return result


def plain_greedy_generate(target: TargetModel, prompt_ids: list[int], max_new_tokens: int,
                          eos_token_id: int | None = None) -> GenerationResult:
    return plain_generate(target, prompt_ids, max_new_tokens, None, None, eos_token_id)


def speculative_generate(target: TargetModel, drafter: DrafterArg, prompt_ids: list[int],
                         max_new_tokens: int, num_draft: int = 4, sampling: SamplingParams | None = None,
                         seed: int | None = None, eos_token_id: int | None = None,
                         on_tokens: Callable[[list[int]], None] | None = None,
                         spec: DraftSpec | None = None) -> GenerationResult:
    """Speculative decoding of one prompt with any drafter (a drafter object of any kind, or
    "ngram"): a chain of `num_draft` tokens, or the tree `spec`. Greedy (sampling None or
    temperature 0): output equals the target's greedy decoding. Otherwise lossless sampling;
    `seed` makes a run reproducible. `on_tokens` receives each round's verified tokens."""
    _check_request(prompt_ids, max_new_tokens, num_draft)
    engine = SpeculativeEngine(target, drafter, spec or DraftSpec.chain(num_draft))
    stream = None if on_tokens is None else (lambda _index, tokens: on_tokens(tokens))
    return engine.generate([prompt_ids], max_new_tokens, sampling, seed, eos_token_id, on_tokens=stream)[0]


def speculative_greedy_generate(target: TargetModel, drafter: DrafterArg, prompt_ids: list[int],
                                max_new_tokens: int, num_draft: int = 4,
                                eos_token_id: int | None = None) -> GenerationResult:
    return speculative_generate(target, drafter, prompt_ids, max_new_tokens, num_draft, None, None, eos_token_id)
