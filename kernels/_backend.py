"""The one switch between the Triton kernels and their PyTorch twins.

    VLLM_MOA_KERNELS = auto | triton | torch      (default: auto)

* ``auto``   Triton for CUDA tensors (when Triton imports), the PyTorch twins otherwise. CPU
             tensors take the twins even under ``TRITON_INTERPRET=1``: the interpreter is a
             correctness tool, orders of magnitude slower than PyTorch.
* ``triton`` always the Triton kernels; on CPU this needs ``TRITON_INTERPRET=1`` set before
             Triton is first imported (the CI does this for the kernel tests).
* ``torch``  always the PyTorch twins (debugging, platforms without Triton).

The variable is read at every call, so it can be changed at run time (tests monkeypatch it).
Every public entry point also takes ``backend=`` ("auto" | "triton" | "torch") to override it.
"""

from __future__ import annotations

import os

import torch

ENV_VAR = "VLLM_MOA_KERNELS"
BACKENDS = ("auto", "triton", "torch")
# auto: LSA over more tokens than this runs as the PyTorch twin on GPUs too. On an H200 (bf16,
# benchmarks/results/bench_kernels_h200_quick.json) the Triton LSA is 1.6-4.8x the twin at 1-128
# tokens and 0.71-0.94x at 1024 (its gather-GEMM reaches ~75 TFLOP/s; cuBLAS's dense GEMM more).
LSA_TOKENS_ENV = "VLLM_MOA_LSA_TRITON_MAX_TOKENS"
LSA_TRITON_MAX_TOKENS = 256

try:  # Triton has no wheels outside Linux; the twins run there.
    import triton  # noqa: F401
    import triton.language  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the platform
    HAS_TRITON = False


def interpreting() -> bool:
    """True when Triton runs under its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_backend(backend: str | None = None) -> str:
    """The requested backend: the argument if given, else $VLLM_MOA_KERNELS, else "auto"."""
    choice = (backend or os.environ.get(ENV_VAR, "") or "auto").strip().lower()
    if choice not in BACKENDS:
        raise ValueError(f"{ENV_VAR} / backend must be one of {', '.join(BACKENDS)}, got {choice!r}")
    return choice


def lsa_triton_max_tokens() -> int:
    """Under "auto", the most tokens one LSA call runs in Triton ($VLLM_MOA_LSA_TRITON_MAX_TOKENS)."""
    raw = os.environ.get(LSA_TOKENS_ENV, "").strip()
    if not raw:
        return LSA_TRITON_MAX_TOKENS
    if not raw.isdigit():
        raise ValueError(f"{LSA_TOKENS_ENV} must be a whole number of tokens, got {raw!r}")
    return int(raw)


def use_triton(device: torch.device | str | None = None, backend: str | None = None) -> bool:
    """Whether kernels on `device` run in Triton (True) or as their PyTorch twins (False).

    Raises RuntimeError when Triton is forced but cannot run there (not installed, or CPU
    tensors without TRITON_INTERPRET=1).
    """
    choice = kernel_backend(backend)
    device = torch.device(device) if device is not None else None
    if choice == "torch":
        return False
    if choice == "auto":
        return HAS_TRITON and device is not None and device.type == "cuda"
    if not HAS_TRITON:
        raise RuntimeError(f"{ENV_VAR}=triton but Triton is not installed")
    if device is not None and device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"{ENV_VAR}=triton with {device.type} tensors needs TRITON_INTERPRET=1 set before Triton is imported"
        )
    return True


def dot_in_fp32(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether kernels should upcast `tl.dot` operands to fp32 (with IEEE precision).

    fp32 inputs: yes, so that results match PyTorch to ~1e-5 (Triton's default for fp32 dots is
    TF32). Under the interpreter: yes, always, because its bf16 `tl.dot` is wrong (Triton 3.x).
    """
    return dtype == torch.float32 or device.type != "cuda" or interpreting()


def load_triton_module(name: str):
    """Import one of this package's Triton kernel modules (``"._lsa_triton"``, ...) lazily, so
    that importing `vllm_moa.kernels` never needs Triton.

    Under the CPU interpreter, TRITON_INTERPRET=1 must be set before Triton is first imported
    (transformers imports it through torch._dynamo): tests/conftest.py sets it first thing on
    machines without an NVIDIA device.
    """
    import importlib

    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed")
    return importlib.import_module(name, __package__)
