"""The drafter's say over the V1 runner's drafting call (`GPUModelRunner.propose_draft_token_ids`),
one patch:

    RunnerProposePatch        GPUModelRunner.propose_draft_token_ids
                                                                a step that schedules no drafts for
                                                                the next one skips vLLM's preparation
                                                                of the drafter's inputs

For a draft model vLLM prepares the drafter's inputs at every step, whatever K the scheduler chose
for the next: the next token of every request (`prepare_next_token_ids_padded`, a per-request
Python loop and a kernel), the drafter's attention metadata (`prepare_inputs_padded`), then calls
the drafter, which at K = 0 only marks the step's slots stale (moa/catch_up.py). On SmolLM2 in
vLLM's CPU engine at 8 requests that preparation was most of what a "moa" step that drafts
nothing cost beyond a step without speculation (about 2-3%, measured with engines taking turns on
their own clocks, integration/serve/engine_turns.py). A drafter with `skip_draftless_step` (the
MoA proposer) is asked first at such a step; where it skips, its answer (no drafts) is the call's.

Both preparations are pure (they fill the drafter's own scratch buffers and return tensors);
what the runner keeps from them is `_copy_valid_sampled_token_count`, which does something only
with asynchronous scheduling (its event exists then). So the shortcut is taken only where that
event is None (synchronous scheduling: always on vLLM's CPU platform), and asynchronous
scheduling keeps vLLM's own path, the drafter still skipping inside it.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_moa.integration.shell.patching import VllmPatch


class RunnerProposePatch(VllmPatch):
    """Around the V1 runner's `propose_draft_token_ids`: at a step whose scheduler output asks for
    no drafts (num_spec_tokens_to_schedule == 0), with synchronous scheduling, the runner's drafter
    may answer alone (`skip_draftless_step(common_attn_metadata, num_tokens)` -> [B, 0] drafts,
    or None to let vLLM's path run)."""

    symbol = "runner_propose_draft_token_ids"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                    sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                    common_attn_metadata, slot_mappings):
            skip = getattr(getattr(self, "drafter", None), "skip_draftless_step", None)
            if skip is not None and scheduler_output.num_spec_tokens_to_schedule == 0 \
                    and getattr(self, "valid_sampled_token_count_event", None) is None:
                drafts = skip(common_attn_metadata, scheduler_output.total_num_scheduled_tokens)
                if drafts is not None:
                    self._draft_probs = None
                    self._draft_prob_req_ids = None
                    return drafts
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                            sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                            slot_mappings)

        setattr(owner, attr, propose_draft_token_ids)
