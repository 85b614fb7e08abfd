"""Shared setup of the kernel tests; every test module here imports it first:

    from kernel_env import device, no_kernel_env_override  # noqa: F401  (fixtures)

* TRITON_INTERPRET=1 is set when CUDA is absent (Triton under its CPU interpreter). It must be
  set before Triton is first imported; tests/conftest.py already does so first thing on machines
  without an NVIDIA device (transformers imports Triton through torch._dynamo).
* In a source checkout that was not `pip install`ed, `vllm_moa.kernels` (the top-level
  `kernels/` folder, mapped by setup.py's package_dir) is registered from the folder.

This is deliberately not a conftest.py: conftest files outside packages are all imported under
the module name "conftest", and a second one would shadow tests/conftest.py.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _register_kernels_package() -> None:
    try:
        import vllm_moa.kernels  # noqa: F401  (installed: setup.py maps it to kernels/)
        return
    except ModuleNotFoundError as err:
        if err.name != "vllm_moa.kernels":
            raise
    import vllm_moa

    folder = Path(__file__).resolve().parents[3] / "kernels"
    spec = importlib.util.spec_from_file_location(
        "vllm_moa.kernels", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_moa.kernels"] = module
    spec.loader.exec_module(module)
    vllm_moa.kernels = module


_register_kernels_package()


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def no_kernel_env_override(monkeypatch):
    """Tests choose kernels explicitly; a VLLM_MOA_KERNELS set outside must not leak in."""
    monkeypatch.delenv("VLLM_MOA_KERNELS", raising=False)
