"""vLLM's metrics for engines side by side in one process.

`LLM.get_metrics()` reads prometheus_client's process-wide registry, and every new engine's
Prometheus stat logger unregisters the vLLM collectors already there
(`vllm.v1.metrics.prometheus.unregister_vllm_metrics`), so with several engines in one process
every engine reads the counters of the last one built. Each engine's logger keeps counting into
its own collector objects, though: take them right after the engine is built, and put them back
in the registry before reading that engine's metrics.

    collectors = engine_collectors()      # right after LLM(...) returns
    ...
    show_only(collectors)                 # then llm.get_metrics() reads this engine's
"""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY

VLLM_PREFIX = "vllm:"


def engine_collectors() -> list[Any]:
    """The vLLM collectors in the registry now: right after an engine is built, that engine's."""
    # the registry has no public listing; vLLM's own unregister_vllm_metrics reads the same map
    return [c for c in list(REGISTRY._collector_to_names) if getattr(c, "_name", "").startswith(VLLM_PREFIX)]


def show_only(collectors: list[Any]) -> None:
    """Put `collectors` in the registry in place of whatever vLLM collectors are there, so that
    LLM.get_metrics() reads the engine they belong to."""
    for collector in engine_collectors():
        REGISTRY.unregister(collector)
    for collector in collectors:
        REGISTRY.register(collector)
