"""The drafter's say over the V1 runner's sampling step (`GPUModelRunner._sample`), one patch:

    RunnerSamplePatch         GPUModelRunner._sample            a step without drafts sampled by
                                                                vLLM's sampler; tree steps accepted
                                                                along the tree

vLLM 0.32 builds spec-decode metadata for every step of a speculative engine, drafts or not, so a
step in which no request has drafts (every step K by measured speed sets to 0, every prefill
step) still goes through the rejection sampler with zero draft rows: it re-runs vLLM's sampler
for the bonus tokens inside, expands per-token sampling parameters and draws uniforms for rows
that do not exist (about 1 ms of a 45 ms step at 32 requests on a 2-core CPU). A MoA drafter asks
for such steps to be sampled as an engine without speculation samples them (`verify_metadata`);
the runner's bookkeeping and the drafter still receive the step's metadata as vLLM built it.
For draft trees the drafter then accepts along the step's trees (`accept_tree_step`).

Both hooks are read from the runner's drafter, so other drafters and engines are untouched.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_moa.integration.shell.patching import VllmPatch


class RunnerSamplePatch(VllmPatch):
    """Around the V1 runner's `_sample`: the drafter chooses the metadata vLLM's sampling sees
    (`verify_metadata(spec_decode_metadata)`: None for a step without drafts), then may accept
    the step's trees (MoAProposer.accept_tree_step -> moa/tree_drafts.py)."""

    symbol = "runner_sample"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def _sample(self, logits, spec_decode_metadata):
            drafter = getattr(self, "drafter", None)
            choose = getattr(drafter, "verify_metadata", None)
            verified = spec_decode_metadata if choose is None else choose(spec_decode_metadata)
            output = original(self, logits, verified)
            accept = getattr(drafter, "accept_tree_step", None)
            if accept is not None:
                accept(self, logits, spec_decode_metadata, output)
            return output

        setattr(owner, attr, _sample)
