"""The simplest correct speculative loop: a drafter (decoding/drafters.py) proposes a chain of K
tokens, the target verifies them in one forward; greedy acceptance or lossless rejection
sampling. Batch 1. At temperature 0 its output equals the target's own
greedy decoding token for token (tests/unit/test_chain_decoding.py).

Round r, with the target's cache holding positions 0..base-1 and `pending` the target's last
(bonus) token at position `base`:
    drafts d_1..d_K   <- the drafter, starting from `pending` (its state covers 0..base-1)
    target forward over [pending, d_1..d_K] at positions base..base+K -> greedy g_0..g_K
    n = longest prefix with d_i == g_{i-1}; new tokens d_1..d_n, bonus g_n
    target cache cropped to base+n+1; the drafter's state rolled forward to the same prefix.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from torch import Tensor

from vllm_moa.decoding.drafters import open_session
from vllm_moa.decoding.sampling import SamplingParams, rejection_sample, sample
from vllm_moa.models import Drafter
from vllm_moa.target import TargetKVCache, TargetModel


@dataclass
class GenerationResult:
    token_ids: list[int]
    target_forwards: int = 0  # decoding forwards (prefill excluded)
    accepted_per_forward: list[int] = field(default_factory=list)  # accepted drafts + 1, per verify
    seconds: float = 0.0
    drafter_seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens gained per target forward: accepted draft tokens + 1 (the bonus)."""
        return sum(self.accepted_per_forward) / max(1, len(self.accepted_per_forward))

    def acceptance_by_position(self, num_draft: int) -> list[float]:
        """Share of rounds whose i-th draft token was accepted, i = 1..num_draft."""
        rounds = max(1, len(self.accepted_per_forward))
        return [sum(1 for a in self.accepted_per_forward if a - 1 >= i) / rounds for i in range(1, num_draft + 1)]

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else float("nan")


def _check_request(prompt_ids: list[int], max_new_tokens: int, num_draft: int | None = None) -> None:
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: give at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if num_draft is not None and num_draft <= 0:
        raise ValueError(f"num_draft must be > 0, got {num_draft}")


def _finish(tokens: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    tokens = tokens[:max_new_tokens]
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[: tokens.index(eos_token_id) + 1]
    return tokens


@torch.no_grad()
def plain_generate(target: TargetModel, prompt_ids: list[int], max_new_tokens: int,
                   sampling: SamplingParams | None = None, seed: int | None = None,
                   eos_token_id: int | None = None) -> GenerationResult:
    """The baseline: one target forward per token, same functional target and cache."""
    _check_request(prompt_ids, max_new_tokens)
    generator = _generator(seed, target.device)
    started = time.perf_counter()
    cache = TargetKVCache()
    logits = target(torch.tensor([prompt_ids], device=target.device), cache).logits
    tokens: list[int] = []
    result = GenerationResult(tokens)
    while True:
        token = _pick(logits[:, -1], sampling, generator)
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


@torch.no_grad()
def speculative_generate(target: TargetModel, drafter: Drafter | str, prompt_ids: list[int],
                         max_new_tokens: int, num_draft: int = 4, sampling: SamplingParams | None = None,
                         seed: int | None = None, eos_token_id: int | None = None,
                         on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Chain speculative decoding (batch 1) with any drafter: MoA, EAGLE-style, independent, or
    "ngram" (prompt lookup). Greedy (sampling None or temperature 0): output equals the target's
    greedy decoding. Otherwise lossless rejection sampling (decoding/sampling.py); `seed` makes
    a run reproducible. `on_tokens` receives the new tokens of every round as soon as the target
    has verified them (streaming); the streamed tokens add up to exactly the returned token_ids."""
    _check_request(prompt_ids, max_new_tokens, num_draft)
    greedy = sampling is None or sampling.greedy
    device = target.device
    generator = _generator(seed, device)
    started = time.perf_counter()
    cache = TargetKVCache()
    prompt = torch.tensor([prompt_ids], device=device)
    prefill = target(prompt, cache)
    session = open_session(drafter, target)
    drafter_time = time.perf_counter()
    session.start(prompt, prefill)
    drafter_seconds = time.perf_counter() - drafter_time
    pending = _pick(prefill.logits[:, -1], sampling, generator)  # [1, 1]
    tokens = [int(pending)]
    emitted = _stream(on_tokens, tokens, 0, max_new_tokens, eos_token_id)
    result = GenerationResult(tokens)
    while len(tokens) < max_new_tokens and int(pending) != eos_token_id:
        base = cache.length
        t0 = time.perf_counter()
        proposal = session.propose(pending, num_draft, sampling, generator)
        drafts = proposal.tokens  # [1, K]
        drafter_seconds += time.perf_counter() - t0
        verified = torch.cat([pending, drafts], dim=1)  # [1, K+1] at positions base..base+K
        verify = target(verified, cache)
        if greedy:
            choice = verify.logits[0].argmax(-1)
            accepted = 0
            while accepted < num_draft and int(drafts[0, accepted]) == int(choice[accepted]):
                accepted += 1
            bonus = choice[accepted].view(1, 1)
        else:
            accepted, bonus = rejection_sample(drafts[0], proposal.probs[0], sampling.probs(verify.logits[0]), generator)
        cache.crop(base + accepted + 1)  # pending + accepted drafts
        t0 = time.perf_counter()
        session.accept(accepted, verified, verify)
        drafter_seconds += time.perf_counter() - t0
        new_tokens = drafts[0, :accepted].tolist() + [int(bonus)]
        tokens.extend(new_tokens)
        emitted = _stream(on_tokens, tokens, emitted, max_new_tokens, eos_token_id)
        result.target_forwards += 1
        result.accepted_per_forward.append(accepted + 1)
        pending = bonus
        if eos_token_id is not None and eos_token_id in new_tokens:
            break
    result.token_ids = _finish(tokens, max_new_tokens, eos_token_id)
    result.seconds = time.perf_counter() - started
    result.drafter_seconds = drafter_seconds
    return result


def speculative_greedy_generate(target: TargetModel, drafter: Drafter | str, prompt_ids: list[int],
                                max_new_tokens: int, num_draft: int = 4,
                                eos_token_id: int | None = None) -> GenerationResult:
    return speculative_generate(target, drafter, prompt_ids, max_new_tokens, num_draft, None, None, eos_token_id)


def _stream(on_tokens: Callable[[list[int]], None] | None, tokens: list[int], emitted: int,
            max_new_tokens: int, eos_token_id: int | None) -> int:
    """Hand the caller the tokens verified since the last call (cut at max_new_tokens / EOS)."""
    if on_tokens is None:
        return emitted
    visible = _finish(tokens[emitted:], max_new_tokens - emitted, eos_token_id)
    if visible:
        on_tokens(visible)
    return emitted + len(visible)


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def _pick(logits: Tensor, sampling: SamplingParams | None, generator: torch.Generator | None) -> Tensor:
    """logits [1, V] -> token [1, 1]: greedy, or sampled from the warped distribution."""
    if sampling is None or sampling.greedy:
        return logits.argmax(-1, keepdim=True)
    return sample(sampling.probs(logits), generator)
