"""The one switch: VLLM_MOA_KERNELS = auto | triton | torch (PyTorch only, no kernel runs)."""

from __future__ import annotations

import pytest
import torch

from vllm_moa import kernels
from vllm_moa.kernels import HAS_TRITON, kernel_backend, use_triton


def test_default_is_auto(monkeypatch):
    assert kernel_backend() == "auto"
    assert use_triton("cpu") is False  # auto: twins on CPU, even under the interpreter
    assert use_triton(torch.device("cuda")) is HAS_TRITON


def test_torch_forces_twins(monkeypatch):
    monkeypatch.setenv("VLLM_MOA_KERNELS", "torch")
    assert use_triton("cuda") is False and use_triton("cpu") is False


def test_triton_forced(monkeypatch):
    monkeypatch.setenv("VLLM_MOA_KERNELS", "triton")
    if not HAS_TRITON:
        with pytest.raises(RuntimeError, match="not installed"):
            use_triton("cpu")
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton("cpu") is True
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        use_triton("cpu")
    assert use_triton("cuda") is True


def test_argument_overrides_env_and_bad_values(monkeypatch):
    monkeypatch.setenv("VLLM_MOA_KERNELS", "triton")
    assert use_triton("cuda", backend="torch") is False
    assert kernel_backend(" Torch ") == "torch"
    monkeypatch.setenv("VLLM_MOA_KERNELS", "cuda")
    with pytest.raises(ValueError, match="auto, triton, torch"):
        use_triton("cpu")


def test_public_api():
    for name in ("lsa_attention", "lsa_attention_reference", "lsa_rows_from_paged", "tree_attention_paged",
                 "tree_attention_reference", "tree_attention_triton", "tree_ancestor_masks", "use_triton"):
        assert name in kernels.__all__ and callable(getattr(kernels, name))
        assert getattr(kernels, name).__doc__


def test_auto_sends_large_lsa_calls_to_the_twin(monkeypatch):
    """Under auto, LSA over more than VLLM_MOA_LSA_TRITON_MAX_TOKENS tokens runs as the twin even
    where Triton would run (GPUs): it is faster there (bench_kernels on an H200); forced triton
    keeps Triton at any size."""
    from vllm_moa.kernels import lsa

    calls = []
    monkeypatch.setattr(lsa, "use_triton", lambda device, backend=None: True)
    monkeypatch.setattr(lsa, "lsa_rows_from_paged", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(lsa, "lsa_attention_reference", lambda *a, **k: calls.append("twin"))
    caches = [torch.zeros(1)]
    for n in (1, 256, 257, 4096):
        lsa.lsa_attention(None, caches, torch.zeros(n, dtype=torch.long))
    lsa.lsa_attention(None, caches, torch.zeros(4096, dtype=torch.long), backend="triton")
    assert calls == ["triton", "triton", "twin", "twin", "triton"]
    monkeypatch.setenv("VLLM_MOA_LSA_TRITON_MAX_TOKENS", "4096")
    calls.clear()
    lsa.lsa_attention(None, caches, torch.zeros(4096, dtype=torch.long))
    assert calls == ["triton"]
    monkeypatch.setenv("VLLM_MOA_LSA_TRITON_MAX_TOKENS", "many")
    with pytest.raises(ValueError, match="VLLM_MOA_LSA_TRITON_MAX_TOKENS must be a whole number"):
        lsa.lsa_attention(None, caches, torch.zeros(4, dtype=torch.long))
