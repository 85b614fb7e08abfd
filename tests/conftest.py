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

# pytest-xdist's workers (-n auto: one per core) each start torch, and torch starts one thread per
# core: 2 workers on 2 cores ran 4 busy threads, whose OpenMP barriers spin against each other. Two
# runtime sampling tests side by side took 424 s so, 106 s with one thread per worker (AVX2 EPYC,
# 2 cores, by hand). So each worker, and every process it starts, gets its share of the cores,
# unless OMP_NUM_THREADS says otherwise.
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if XDIST_WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // XDIST_WORKERS))

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_hf_target, make_target  # noqa: E402

if "OMP_NUM_THREADS" in os.environ:  # a plugin may have imported torch before the line above
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(params=["llama", "qwen2"])
def tiny_target(request):
    return make_target(request.param)


@pytest.fixture
def tiny_target_dir(tmp_path):
    path = tmp_path / "tiny-llama"
    make_hf_target("llama").save_pretrained(path)
    return path
