"""engine_metrics (vllm_moa/integration/serve/engine_metrics.py): engines side by side in one
process read their own counters, although each new engine's logger takes the earlier engines'
collectors out of prometheus' registry (as vLLM's unregister_vllm_metrics does, done here with the
same registry calls; no vLLM needed)."""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter

from vllm_moa.integration.serve.engine_metrics import engine_collectors, show_only

NAME = "vllm:test_engine_metrics_drafts"


def _new_engine_logger(drafts: int) -> Counter:
    """What a new engine's stat logger does to the registry: vLLM's collectors out, its own in."""
    for collector in engine_collectors():
        REGISTRY.unregister(collector)
    counter = Counter(NAME, "drafts of one engine")
    counter.inc(drafts)
    return counter


def _read() -> float:
    return REGISTRY.get_sample_value(NAME + "_total")


def test_each_engine_reads_its_own_counters_after_a_later_one_was_built():
    first = _new_engine_logger(3)
    first_collectors = engine_collectors()
    second = _new_engine_logger(40)
    second_collectors = engine_collectors()
    try:
        first.inc(2)  # the first engine keeps counting into its own collector
        assert _read() == 40  # the registry shows the last engine's only: what vLLM's get_metrics reads
        show_only(first_collectors)
        assert _read() == 5
        show_only(second_collectors)
        second.inc()
        assert _read() == 41
        assert first_collectors != second_collectors
    finally:
        for collector in engine_collectors():
            REGISTRY.unregister(collector)
