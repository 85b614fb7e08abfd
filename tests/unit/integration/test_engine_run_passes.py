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
