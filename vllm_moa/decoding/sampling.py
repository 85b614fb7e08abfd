"""Sampling parameters and lossless speculative sampling for chains.

Rejection sampling (Leviathan et al., 2023; Chen et al., 2023): drafts d_1..d_k were sampled
from the drafter's distributions q_1..q_k; the target gives p_1..p_{k+1} at the same positions.
d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is
drawn from norm(max(p_i - q_i, 0)) and the round ends; if all k are accepted a bonus token is drawn
from p_{k+1}. The output is distributed exactly as sampling from p token by token, for any q
(tests/unit/test_sampling.py checks this with a chi-square test). p and q are the *warped*
distributions (temperature, top-k, top-p), so the output follows the target's warped sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and self.temperature == self.temperature):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: Tensor) -> Tensor:
        """Warped next-token distribution: logits [..., V] -> probabilities [..., V] (fp32)."""
        logits = logits.float() / self.temperature
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


def rejection_sample(drafts: Tensor, draft_probs: Tensor, target_probs: Tensor,
                     generator: torch.Generator | None) -> tuple[int, Tensor]:
    """drafts [k], draft_probs q [k, V], target_probs p [k+1, V] -> (accepted count n, next token [1, 1]).

    The next token is the residual sample at the first rejection, or the bonus from p_{k+1}."""
    k = drafts.shape[0]
    for i in range(k):
        token = int(drafts[i])
        p, q = target_probs[i, token], draft_probs[i, token]
        u = torch.rand((), generator=generator, device=drafts.device)
        if q > 0 and u * q <= p:  # accept with probability min(1, p/q)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        if residual.sum() <= 0:  # p == q exactly: any rejection is measure-zero; fall back to p
            residual = target_probs[i]
        return i, sample((residual / residual.sum())[None], generator)
    return k, sample(target_probs[k][None], generator)
