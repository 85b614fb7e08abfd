"""Sampling parameters, warping (temperature, top-k, top-p) and the target's own token choice.

Draft acceptance, lossless for chains and trees, is in decoding/verify.py. p and q there are the
*warped* distributions of `SamplingParams.probs`, so the output follows the target's warped
sampling.

Temperature: a finite number in [0, MAX_TEMPERATURE]. Below MIN_TEMPERATURE (0 included) it is
greedy decoding: at such a temperature the warped distribution is a point mass on the argmax for
any logit gap the model can express, and dividing by it would overflow. This is the one place
the range is defined: the runtime, the server's request schema and the CLIs all use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MIN_TEMPERATURE = 1e-5  # below this (0 included): greedy
MAX_TEMPERATURE = 100.0  # above this the warped distribution is uniform to within fp32 rounding


def check_temperature(temperature: float) -> float:
    """The temperature if it is valid, else ValueError naming the valid range."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not 0 <= temperature <= MAX_TEMPERATURE:  # False for nan
        raise ValueError(f"temperature must be a finite number in [0, {MAX_TEMPERATURE:g}] (0, or anything below "
                         f"{MIN_TEMPERATURE:g}, is greedy), got {temperature!r}")
    return float(temperature)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def probs(self, logits: Tensor) -> Tensor:
        """Warped next-token distribution: logits [..., V] -> probabilities [..., V] (fp32).

        The logits are shifted so that their maximum is 0 before the division: every scaled value is
        then <= 0 and no temperature in the valid range can overflow them (the argmax keeps
        probability mass, so the softmax never divides by zero). Greedy temperatures give the point
        mass on the argmax (their limit)."""
        logits = logits.float()
        if self.greedy:
            return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
            sorted_probs = sorted_probs.masked_fill(before >= self.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """probs [1, V] -> token [1, 1]"""
    return torch.multinomial(probs, 1, generator=generator)


def pick(logits: Tensor, sampling: SamplingParams | None, generator: torch.Generator | None) -> Tensor:
    """The target's own choice: logits [1, V] -> token [1, 1], greedy or sampled from the warped
    distribution."""
    if sampling is None or sampling.greedy:
        return logits.argmax(-1, keepdim=True)
    return sample(sampling.probs(logits), generator)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)
