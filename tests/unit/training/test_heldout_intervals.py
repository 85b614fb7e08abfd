"""Resampling intervals of the held-out benchmark (benchmarks/heldout_agreement_smollm2.py): the
chain estimate from summed counts, and paired intervals that are exactly zero for a drafter
compared with itself and exclude zero for a clearly better one."""

from __future__ import annotations

import numpy as np

from benchmarks.heldout_agreement_smollm2 import bootstrap, chain_estimate
from vllm_moa.training.losses import agreement_of_sequences as agreement


def _sequences(rate: float, n: int = 60, seed: int = 0) -> list[tuple[list[float], list[float]]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        counts = rng.integers(5, 15, size=7).astype(float)
        out.append((rng.binomial(counts.astype(int), rate).astype(float).tolist(), counts.tolist()))
    return out


def test_chain_estimate_and_agreement():
    hits, counts = np.array([9.0, 5, 4, 3]), np.array([10.0, 10, 10, 10])
    assert chain_estimate(hits, counts) == 1 + 0.5 + 0.5 * 0.4 + 0.5 * 0.4 * 0.3
    assert agreement([([1.0, 2.0], [2.0, 4.0]), ([1.0, 0.0], [2.0, 0.0])]) == [0.5, 0.5]


def test_paired_intervals():
    base, better = _sequences(0.5), _sequences(0.7, seed=1)
    rows = [{"label": "a", "split": "heldout", "per_sequence": base},
            {"label": "same", "split": "heldout", "per_sequence": base},
            {"label": "better", "split": "heldout", "per_sequence": better}]
    out = bootstrap(rows, 500)
    assert out[("same", "heldout")]["chain3_minus_first_95"] == [0.0, 0.0]
    low, high = out[("better", "heldout")]["chain3_minus_first_95"]
    assert 0 < low < high
    low, high = out[("a", "heldout")]["chain3_estimate_95"]
    assert low < out[("a", "heldout")]["chain3_estimate"] < high


def test_training_curve_walks_the_card_and_extrapolates_along_its_fit():
    """benchmarks/training_curve_smollm2.py: x accumulates each run's tokens, y is the agreement
    the next run started from (the card's own figure last), and the fit's goal lies on its line."""
    from benchmarks.training_curve_smollm2 import FEATURE_CACHE_MEAN_TOKENS, FIRST_BATCH, drafter_points, fit

    flat = [0.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    entry = {"steps": 10, "heldout_agreement_by_depth": [0.0, 0.9] * 3 + [0.9],
             "long_runs": [{"target_tokens": 1000, "heldout_agreement_before": flat, "cores": 2},
                           {"target_tokens": 9000, "heldout_agreement_before": [0.0] + [0.8] * 6,
                            "accelerator": "GPU"}]}
    points = drafter_points(entry)
    start = round(10 * FIRST_BATCH * FEATURE_CACHE_MEAN_TOKENS)
    assert [p["tokens"] for p in points] == [start, start + 1000, start + 10_000]
    assert points[0]["chain3_estimate"] == 1.875 and points[1]["chain3_estimate"] == 1 + 0.8 + 0.64 + 0.512
    assert points[2]["after"] == "GPU: 0.0M tokens"
    line = [{"tokens": 10**k, "chain3_estimate": 1.0 + 0.25 * k} for k in (3, 4, 5)]
    result = fit(line, goal=2.5)
    assert result["per_10x_tokens"] == 0.25 and result["last_point_residual"] == 0.0
    assert result["tokens_for_goal"] == result["tokens_for_goal_from_last_point"] == 1e6
