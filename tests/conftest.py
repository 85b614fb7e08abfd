"""Shared fixtures. Helpers live in tiny_models.py (a module name no other conftest can shadow)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

# Triton decides at import whether @triton.jit kernels are compiled or interpreted, and torch /
# transformers import Triton early: choose the CPU interpreter before anything else is imported.
if not (os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi")):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_hf_target, make_target  # noqa: E402


@pytest.fixture(params=["llama", "qwen2"])
def tiny_target(request):
    return make_target(request.param)


@pytest.fixture
def tiny_target_dir(tmp_path):
    path = tmp_path / "tiny-llama"
    make_hf_target("llama").save_pretrained(path)
    return path
