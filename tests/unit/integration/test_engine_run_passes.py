"""EngineResult.first_passes (vllm_moa/integration/serve/offline.py): a run of n passes read as the
run of its first passes, which the vLLM engine tests share one engine through (no vLLM needed)."""

from __future__ import annotations

import pytest

from vllm_moa.integration.serve.offline import EngineResult, PassResult, SpecDecodeCounters


def _pass(drafts: int, accepted: int, per_pos: list[int], hits: int, preempted: int) -> PassResult:
    return PassResult(concurrency=2, outputs=[[drafts], [accepted]], seconds=1.0,
                      spec_decode=SpecDecodeCounters(drafts=drafts, draft_tokens=3 * drafts, accepted=accepted,
                                                     accepted_per_pos=per_pos),
                      prefix_cache_hits=hits, preemptions=preempted)


def _run() -> EngineResult:
    passes = [_pass(10, 12, [7, 4, 1], 0, 2), _pass(8, 16, [8, 6, 2], 96, 0), _pass(5, 1, [1, 0, 0], 96, 1)]
    total = SpecDecodeCounters(drafts=23, draft_tokens=69, accepted=29, accepted_per_pos=[16, 10, 3])
    return EngineResult(passes=passes, startup_seconds=3.0, spec_decode=total, prefix_cache_hits=192, preemptions=3)


def test_the_first_pass_alone_has_that_pass_s_counters():
    first = _run().first_passes(1)
    assert first.passes == _run().passes[:1]
    assert first.spec_decode == _run().passes[0].spec_decode
    assert first.spec_decode.acceptance_length == pytest.approx(1 + 12 / 10)
    assert (first.prefix_cache_hits, first.preemptions) == (0, 2)


def test_the_first_two_passes_add_up():
    two = _run().first_passes(2)
    assert len(two.passes) == 2
    assert two.spec_decode == SpecDecodeCounters(drafts=18, draft_tokens=54, accepted=28, accepted_per_pos=[15, 10, 3])
    assert (two.prefix_cache_hits, two.preemptions) == (96, 2)
    assert _run().first_passes(3).spec_decode == _run().spec_decode  # all of them: the run's own counters


@pytest.mark.parametrize("n", [0, 4])
def test_passes_the_run_does_not_have_are_refused(n):
    with pytest.raises(ValueError, match="has no first"):
        _run().first_passes(n)


def test_a_pass_s_counters_are_the_difference_of_two_readings():
    """Meters.since: what the engines side by side (benchmarks/vllm_cpu_sweep.py --side-by-side)
    and execute both read a pass's own counters through."""
    from vllm_moa.integration.serve.offline import Meters

    before = Meters(spec_decode=SpecDecodeCounters(drafts=4, draft_tokens=12, accepted=5, accepted_per_pos=[3, 2, 0]),
                    prefix_cache_hits=32, preemptions=1, inter_token=(2.0, 40))
    after = Meters(spec_decode=SpecDecodeCounters(drafts=10, draft_tokens=30, accepted=17, accepted_per_pos=[8, 6, 3]),
                   prefix_cache_hits=96, preemptions=1, inter_token=(3.5, 70))
    since = after.since(before)
    assert since["spec_decode"] == SpecDecodeCounters(drafts=6, draft_tokens=18, accepted=12, accepted_per_pos=[5, 4, 3])
    assert (since["prefix_cache_hits"], since["preemptions"]) == (64, 0)
    assert since["inter_token_seconds"] == pytest.approx(1.5 / 30)
    assert after.since(after)["inter_token_seconds"] is None  # no step between two readings: no time per step
    assert after.since(Meters())["spec_decode"] == after.spec_decode  # a fresh engine's first pass: all it counted
