"""Speculation that pays or turns itself down (decoding/speed_control.py): the controller's choices
under known costs and acceptance (the runtime's output with it: test_engine.py)."""

import random

import pytest

from vllm_moa.decoding.speed_control import SpeedController


def simulate(batch: int, verify_s, draft_s_per_level: float, rate: float, rounds: int = 300) -> dict[int, int]:
    """Rounds of a chain of up to 4 under a synthetic machine: the depths the controller chose."""
    rng = random.Random(0)
    controller = SpeedController([1, 2, 3, 4], nodes=lambda k: k)
    for _ in range(rounds):
        depth = controller.choose(batch)
        accepted = []
        for _ in range(batch):
            k = 0
            while k < depth and rng.random() < rate:
                k += 1
            accepted.append(k)
        controller.observe(batch, depth, verify_s(batch * (depth + 1 if depth else 1)), draft_s_per_level * batch * depth,
                           accepted)
    return controller.chosen


def test_speculates_where_verification_is_nearly_free_and_turns_off_where_it_is_not():
    memory_bound = lambda tokens: 0.05 + 0.0005 * tokens  # noqa: E731 (batch 1 on a CPU: weights dominate)
    chosen = simulate(1, memory_bound, 0.004, rate=0.7)
    assert sum(n for d, n in chosen.items() if d >= 2) > 0.9 * 300, chosen
    compute_bound = lambda tokens: 0.01 + 0.004 * tokens  # noqa: E731 (a large batch: every token costs)
    chosen = simulate(16, compute_bound, 0.004, rate=0.3)
    plain = chosen.get(0, 0)
    assert plain > 0.95 * 300, chosen
    # it keeps probing: after 16 plain rounds, then 32, 64, 128 (each probe that changes nothing doubles it)
    assert 3 <= sum(chosen.values()) - plain <= 8, chosen


def test_acceptance_decides_at_equal_costs():
    costs = lambda tokens: 0.02 + 0.002 * tokens  # noqa: E731
    assert simulate(4, costs, 0.001, rate=0.9).get(0, 0) < 30
    assert simulate(4, costs, 0.001, rate=0.05).get(0, 0) > 250


def test_bad_depths_are_refused():
    with pytest.raises(ValueError, match="depths must be >= 1"):
        SpeedController([0, 2], nodes=lambda k: k)
