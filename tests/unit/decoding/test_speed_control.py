"""Speculation that pays or turns itself down (decoding/speed_control.py): the controller's choices
under known costs and acceptance (the runtime's output with it: test_engine.py)."""

import random

import pytest

from vllm_moa.decoding.speed_control import FasterShape, SpeedController


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
    # it keeps probing: after 16 plain rounds, then once plain rounds have taken 50x what that probe
    # cost beyond a plain round (a 2% budget; here about 350 rounds)
    assert sum(chosen.values()) - plain == 2, chosen
    chosen = simulate(16, compute_bound, 0.004, rate=0.3, rounds=1200)
    assert 3 <= sum(chosen.values()) - chosen.get(0, 0) <= 5, chosen


def _probe_rounds(probe_budget: float, rounds: int = 1600) -> list[int]:
    """Rounds at batch 16 where speculation does not pay; each probe's catch-up costs as much as
    10 plain rounds: the rounds that probed."""
    verify = lambda tokens: 0.01 + 0.004 * tokens  # noqa: E731 (a large batch: every token costs)
    controller = SpeedController([1, 2, 3, 4], nodes=lambda k: k, max_probe_every=16, probe_budget=probe_budget)
    probes = []
    for i in range(rounds):
        depth = controller.choose(16)
        catch_up = 10 * verify(16) if depth and i > 0 else 0.0  # the first round has nothing to catch up
        controller.observe(16, depth, verify(16 * (depth + 1 if depth else 1)), 0.001 * 16 * depth, [0] * 16,
                           catch_up)
        if depth and i > 0:
            probes.append(i)
    return probes


def test_probes_wait_until_plain_rounds_have_paid_for_the_last_one():
    """With a budget of 2%, a probe that cost 10 plain rounds is followed by the next one only
    after 500 plain rounds' time, although probe_every (16) allows one every 16 rounds."""
    probes = _probe_rounds(0.02)
    assert len(probes) >= 2 and min(b - a for a, b in zip(probes, probes[1:])) >= 500, probes
    assert len(_probe_rounds(1e9)) >= 50  # without the budget: every 16 rounds or so


def test_acceptance_decides_at_equal_costs():
    costs = lambda tokens: 0.02 + 0.002 * tokens  # noqa: E731
    assert simulate(4, costs, 0.001, rate=0.9).get(0, 0) < 30
    assert simulate(4, costs, 0.001, rate=0.05).get(0, 0) > 250


def test_bad_depths_are_refused():
    with pytest.raises(ValueError, match="depths must be >= 1"):
        SpeedController([0, 2], nodes=lambda k: k)


def test_one_bad_batch_round_does_not_erase_what_many_rounds_measured():
    """Acceptance forgets by trials, not by sequences: after 50 rounds at about 0.9, one round of
    8 sequences that all rejected their first token is 8 trials among the last ~128 (a decay per
    sequence forgot the history 8 times within that round, and the estimate fell below 0.3)."""
    controller = SpeedController([3], nodes=lambda k: k)
    rng = random.Random(0)
    for _ in range(50):
        controller.observe(8, 3, 0.1, 0.01, [sum(1 for _ in range(3) if rng.random() < 0.9) for _ in range(8)])
    before = controller.acceptance.rate
    controller.observe(8, 3, 0.1, 0.01, [0] * 8)
    assert before > 0.8 and controller.acceptance.rate > before - 0.1, (before, controller.acceptance.rate)


def test_near_a_tie_a_batch_keeps_drafting_where_drafting_pays():
    """Batch 8, depth 1 pays about 8% over plain decoding (acceptance 0.7): noisy estimates must
    not turn drafting off for good (plain rounds bring no data to correct a low estimate)."""
    verify = lambda tokens: 0.02 + 0.001 * tokens  # noqa: E731
    drafted = []
    for seed in range(6):
        rng = random.Random(seed)
        controller = SpeedController([1, 2, 3], nodes=lambda k: k)
        for _ in range(1000):
            depth = controller.choose(8)
            accepted = []
            for _ in range(8):
                k = 0
                while k < depth and rng.random() < 0.7:
                    k += 1
                accepted.append(k)
            controller.observe(8, depth, verify(8 * (depth + 1 if depth else 1)) * rng.uniform(0.9, 1.1),
                               0.001 * 8 * depth, accepted)
        drafted.append(1 - controller.chosen.get(0, 0) / 1000)
    assert min(drafted) > 0.8, drafted


def _race(rates, rounds: int = 600, batch: int = 1, switch_at: int | None = None):
    """FasterShape over shapes whose rounds give 1 token in 1 / rate seconds (rates swap at
    `switch_at`): the shapes it chose, in order."""
    chooser = FasterShape(list(rates))
    chosen = []
    for i in range(rounds):
        current = rates if switch_at is None or i < switch_at else dict(zip(rates, reversed(rates.values())))
        shape = chooser.choose(batch)
        chooser.observe(batch, shape, 1.0, 1.0 / current[shape])
        chosen.append(shape)
    return chooser, chosen


def test_faster_shape_settles_on_the_faster_shape_and_probes_rarely():
    chooser, chosen = _race({"tree": 90.0, "chain": 100.0})
    assert chosen[:4].count("tree") == 2 and chosen[:4].count("chain") == 2  # both measured first
    late = chosen[100:]
    assert late.count("chain") / len(late) > 0.95
    assert 0 < late.count("tree") <= 10  # probes, at doubling intervals
    assert chooser.rate(1, "chain") == pytest.approx(100.0)


def test_faster_shape_follows_a_change_of_verdict():
    _, chosen = _race({"tree": 90.0, "chain": 100.0}, rounds=1200, switch_at=300)
    assert chosen[250:300].count("chain") >= 45
    assert chosen[-200:].count("tree") >= 190


def test_faster_shape_keeps_a_verdict_per_batch_size():
    chooser = FasterShape(["tree", "chain"])
    rates = {1: {"tree": 120.0, "chain": 100.0}, 16: {"tree": 80.0, "chain": 100.0}}
    for _ in range(300):
        for batch in (1, 16):
            shape = chooser.choose(batch)
            chooser.observe(batch, shape, batch, batch / rates[batch][shape])
    assert chooser.choose(1) == "tree" and chooser.choose(16) == "chain"
    with pytest.raises(ValueError, match="two or more distinct shapes"):
        FasterShape(["tree"])


def test_faster_shape_borrows_the_nearest_measured_batch_size():
    """A batch shrinking as requests finish passes through sizes whose rounds are never priced
    (the batch changed in between): there the verdict of the nearest measured size holds, instead
    of trying the unmeasured shapes round after round. With nothing measured within a factor of
    2, the shapes take turns, priced or not."""
    chooser = FasterShape(["tree", "chain"])
    for _ in range(100):  # batch 16 measured: the chain is faster
        shape = chooser.choose(16)
        chooser.observe(16, shape, 16.0, 16.0 / {"tree": 60.0, "chain": 100.0}[shape])
    tail = [chooser.choose(b) for b in (15, 14, 13, 12) for _ in range(8)]  # never priced
    assert tail.count("chain") == len(tail)
    assert [chooser.choose(12) for _ in range(8)].count("tree") == 1  # the 16th round at 12: a try
    assert [chooser.choose(4) for _ in range(4)] == ["tree", "chain"] * 2  # 16 is too far from 4 to tell
    fresh = FasterShape(["tree", "chain"])
    assert [fresh.choose(3) for _ in range(6)] == ["tree", "chain"] * 3
