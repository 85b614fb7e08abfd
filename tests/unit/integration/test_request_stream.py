"""Poisson arrivals of request_stream.py (the replay itself runs in vLLM's engine:
tests/integration/vllm/test_vllm_engine.py::test_a_request_stream_yields_what_batches_yield)."""

from __future__ import annotations

import statistics

import pytest

from vllm_moa.integration.serve.request_stream import poisson_arrivals


def test_poisson_arrivals_are_seeded_ordered_and_at_the_rate():
    times = poisson_arrivals(4.0, 2000, seed=3)
    assert times == poisson_arrivals(4.0, 2000, seed=3) and times != poisson_arrivals(4.0, 2000, seed=4)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)  # 1 / rate
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.15)  # exponential: sd = mean


@pytest.mark.parametrize("rate,count", [(0.0, 4), (-1.0, 4), (2.0, 0)])
def test_a_stream_without_rate_or_requests_is_refused(rate, count):
    with pytest.raises(ValueError, match="rate > 0 and count >= 1"):
        poisson_arrivals(rate, count, seed=0)
