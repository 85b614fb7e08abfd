"""Engine runs that vLLM must refuse before its engine starts, all the cases of a test file tried
in one EngineHost (vllm_moa/integration/serve/engine_host.py; a plain module, like vllm_env.py):
vLLM is imported once for them all instead of once per case, and each case is still tried,
logged and checked for orphans on its own."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_moa.integration.serve.engine_host import EngineHost
from vllm_moa.integration.serve.offline import EngineRun, EngineRunFailed

CASE_SECONDS = 300  # a case that runs longer hangs


@dataclass
class Refusal:
    refused: bool  # LLM(...) raised by itself (not: it started, or it hung)
    message: str  # what went wrong (the log's root causes), then the log's last lines
    log: str
    orphans: bool  # processes the case started outlived its refusal


def refusals(runs: dict[str, EngineRun], env: dict[str, str] | None = None) -> dict[str, Refusal]:
    """Try every run of `runs` in one host process; what each case came to, by name."""
    outcomes: dict[str, Refusal] = {}
    with EngineHost(env=env) as host:
        for name, run in runs.items():
            try:
                host.run(run, timeout=CASE_SECONDS)
                outcomes[name] = Refusal(False, "the engine started: the run was not refused", "", False)
            except EngineRunFailed as failure:
                outcomes[name] = Refusal(not failure.timed_out, str(failure), failure.log, failure.orphans)
    return outcomes
