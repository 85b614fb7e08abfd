"""Drafter losses (docs/method.md section 2) and per-depth agreement metrics.

loss = kl_weight * KL(p_target || q_draft) + feature_weight * SmoothL1(features), averaged over
trained positions. KL and soft cross-entropy differ by the target's entropy, a constant for the
drafter, so their gradients are equal; KL is reported because it is 0 at a perfect drafter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_moa.models.base import DraftOutput


@dataclass
class LossParts:
    """Sums over trained positions (divide by `count` for means)."""

    total: Tensor
    kl: Tensor
    feature: Tensor
    count: Tensor


def forward_kl(draft_logits: Tensor, target_logits: Tensor) -> Tensor:
    """KL(p_target || q_draft) per position: [..., V] -> [...] (fp32)."""
    log_p = F.log_softmax(target_logits.float(), dim=-1)
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def drafter_loss(output: DraftOutput, target_logits: Tensor, loss_mask: Tensor,
                 kl_weight: float, feature_weight: float) -> LossParts:
    """Sums over `loss_mask` [B, T] positions of each loss part."""
    mask = loss_mask.float()
    kl = (forward_kl(output.logits, target_logits) * mask).sum()
    feature = torch.zeros((), device=target_logits.device)
    for predicted, wanted, weight in output.features:
        per_position = F.smooth_l1_loss(predicted.float(), wanted.float().detach(), reduction="none").mean(-1)
        feature = feature + weight * (per_position * mask).sum()
    total = kl_weight * kl + feature_weight * feature
    return LossParts(total, kl.detach(), feature.detach(), mask.sum())


@torch.no_grad()
def agreement_by_depth(draft_tokens: Tensor, target_tokens: Tensor, depth: Tensor, loss_mask: Tensor,
                       max_depth: int) -> tuple[Tensor, Tensor]:
    """Top-1 agreement with the target per draft depth k = i - s(i), k = 0..max_depth.

    draft_tokens, target_tokens: [B, T] argmax next tokens (target ids; see DraftOutput.tokens).
    Returns (hits, counts), each [max_depth + 1]. Depth 0 is the anchor itself (the target's own
    next token at inference); depth k >= 1 is the k-th drafted token.
    """
    same = draft_tokens == target_tokens
    hits = torch.zeros(max_depth + 1, device=draft_tokens.device)
    counts = torch.zeros(max_depth + 1, device=draft_tokens.device)
    for k in range(max_depth + 1):
        sel = loss_mask & (depth == k)
        hits[k] = (same & sel).sum()
        counts[k] = sel.sum()
    return hits, counts


def agreement_of_sequences(per_sequence: Sequence[tuple[Sequence[float], Sequence[float]]]) -> list[float | None]:
    """Agreement by depth from per-sequence (hits, counts) (Trainer.evaluate_by_sequence), rounded
    to 4 places; [] for no sequences."""
    if not per_sequence:
        return []
    hits = torch.tensor([h for h, _ in per_sequence]).sum(0)
    counts = torch.tensor([c for _, c in per_sequence]).sum(0)
    return [round((h / c).item(), 4) if c > 0 else None for h, c in zip(hits, counts)]
