"""Shared setup of the kernel tests (fixtures `device`, `no_kernel_env_override`):

* TRITON_INTERPRET=1 is set when CUDA is absent (Triton under its CPU interpreter). It must be
  set before Triton is first imported; tests/conftest.py already does so first thing on machines
  without an NVIDIA device (transformers imports Triton through torch._dynamo).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def no_kernel_env_override(monkeypatch):
    """Tests choose kernels explicitly; a VLLM_MOA_KERNELS set outside must not leak in."""
    monkeypatch.delenv("VLLM_MOA_KERNELS", raising=False)
