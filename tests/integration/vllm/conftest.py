"""Shared set-up for the vLLM plugin tests (marker `vllm`; CPU only).

Every test module here is marked `vllm` and starts with `pytest.importorskip("vllm.config")`,
so without vLLM (the main test environment) they are skipped with a reason. With vLLM, vLLM's
CpuPlatform is selected first on machines without a GPU (vllm_env.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from vllm_env import DEMO, MOA_ALONE, engine_config, has_vllm, select_cpu_platform, xdist_worker_binding  # noqa: E402

if has_vllm():
    select_cpu_platform()
# pytest-xdist: this worker's engines (and the servers and CLIs its tests start) on a core of its own
os.environ.update(xdist_worker_binding())


@pytest.fixture(scope="session")
def demo_target():
    return str(DEMO / "target")


@pytest.fixture(scope="session")
def demo_drafter():
    return str(DEMO / "moa-tli0")


@pytest.fixture(scope="session")
def moa_config(demo_target, demo_drafter):
    return engine_config(demo_target, {"method": "moa", "model": demo_drafter, "num_speculative_tokens": 4, **MOA_ALONE})


@pytest.fixture(scope="session")
def vllm_distributed():
    """vLLM's parallel layers need its (single-rank, gloo) process groups."""
    import socket

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
            initialize_model_parallel(1, 1)
    yield


# -- CI: the engine tests must run, not skip ----------------------------------------------------
# With VLLM_MOA_REQUIRE_ENGINE_TESTS=1 (noxfile.py's vllm_cpu session) the session fails when no
# test marked vllm_engine ran, or when any of them was skipped: an environment where vLLM's
# engine cannot start would otherwise pass by skipping everything that matters.
REQUIRE_ENGINE_ENV = "VLLM_MOA_REQUIRE_ENGINE_TESTS"
_engine_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report):
    if "vllm_engine" in report.keywords and (report.when == "call" or report.outcome != "passed"):
        _engine_outcomes[report.nodeid] = report.outcome if report.when == "call" or report.outcome == "skipped" \
            else "failed"


def missing_engine_tests(outcomes: dict[str, str]) -> str | None:
    """Why the engine tests do not count as run (None: they all ran)."""
    if not outcomes:
        return "no test of vLLM's engine ran (marker vllm_engine)"
    skipped = sorted(node for node, outcome in outcomes.items() if outcome == "skipped")
    if skipped:
        return f"{len(skipped)} of {len(outcomes)} engine tests were skipped, e.g. {skipped[0]}"
    return None


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get(REQUIRE_ENGINE_ENV) != "1" or hasattr(session.config, "workerinput"):
        return  # pytest-xdist: the controller, which receives every worker's reports, decides
    reason = missing_engine_tests(_engine_outcomes)
    if reason is not None:
        session.config.get_terminal_writer().line(f"{REQUIRE_ENGINE_ENV}=1: {reason}", red=True)
        session.exitstatus = 1
