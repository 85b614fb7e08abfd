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
