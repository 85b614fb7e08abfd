"""MoAProposer: vLLM 0.26's draft-model proposer, plus MoA's tap on the target's KV cache.

What vLLM already does for a draft model (SpecDecodeBaseProposer / DraftModelProposer), and
MoA keeps: one extra slot per request for the token the target just sampled, rejected drafts
padded out of the batch (slot -1) without a host sync, the draft model's own attention layers
in the target's block tables (prefix caching, chunked prefill and preemption come with them),
K drafting steps for every request of the batch, greedy or probabilistic draft sampling,
CUDA graphs (piecewise) and the spec-decode metrics.

What MoA adds:
    1. the tap (`propose`, before vLLM's loop): the step's scheduled tokens' slots in the
       target's per-layer paged KV cache -> LSA -> Ekv2E rows -> CA keys/values written at
       the same slots of CA's paged cache (rejected drafts skipped: tap.tap_write_slots);
    2. CA's own attention metadata: sequence lengths = the verified count (tap.row_seq_lens),
       non-causal in the first pass (like vLLM's DFlash drafter, the drafter's backend is
       chosen among those that support it), and no KV writes in the forward (no slot mapping);
    3. draft trees (speculative_config "moa_tree": tree_drafts.py grows them,
       tree_verification.py verifies them) and lookup drafts beside the model's ("moa_retrieval",
       lookup_drafts.py);
    4. chains skip steps that vLLM schedules without drafts (dynamic K = 0) and catch up when
       drafting resumes (catch_up.py; VLLM_MOA_CATCH_UP=0 runs vLLM's first pass at every step
       instead).
This class keeps the tap and the order of a step (`propose`, read top to bottom as vLLM's
EagleProposer.propose); each concern lives in its own module and is called from here.
The embedding and LM head are the target's own modules (shared, never copied).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig, get_layers_from_vllm_config, replace
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_moa import envs
from vllm_moa.integration.moa import catch_up, draft_attention, target_layers, tree_levels
from vllm_moa.integration.moa.draft_model import MoADraftModel
from vllm_moa.integration.moa.lookup_drafts import LookupDrafting
from vllm_moa.integration.moa.tap import tap_write_slots
from vllm_moa.integration.moa.tree_drafts import TreeDrafting
from vllm_moa.integration.shell import compat
from vllm_moa.integration.shell.draft_config import (
    UnsupportedMoASetup,
    check_kv_cache_dtype,
    requested_retrieval,
)
from vllm_moa.integration.shell.runner_view import RunnerView

logger = init_logger(__name__)


class MoAProposer(DraftModelProposer):
    """vLLM's draft-model proposer for MoADraftModel, with the tap (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None) -> None:
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        check_kv_cache_dtype(vllm_config.cache_config.cache_dtype, str(vllm_config.model_config.dtype).removeprefix("torch."))
        self._runner = runner
        self._target_layers: list[nn.Module] = []
        self._ca_layer_names: set[str] = set()
        self._tli_layer_names: list[str] = []  # TLI > 0: the target attention layers the drafter runs
        self._kv_layout: compat.KVLayout | None = None
        self._num_rejected: torch.Tensor | None = None  # [B] of the step being drafted
        self._sample_indices: torch.Tensor | None = None  # [B] first pass: each request's drafting token
        self._first_pass_metadata: dict[str, object] = {}  # tree levels read SA's block table from it
        self._root_hidden: torch.Tensor | None = None  # [B, E] trees: the first pass's output at the roots
        self.stale_slots = catch_up.StaleSlots()  # slots of steps skipped at K = 0
        spec = vllm_config.speculative_config
        self.trees = TreeDrafting.for_engine(vllm_config, torch.device(device), logger)  # None: chains
        retrieval = requested_retrieval(spec)
        self.lookups = None if retrieval is None else LookupDrafting(retrieval, self.trees and self.trees.spec.depth)

    def _create_draft_vllm_config(self) -> VllmConfig:
        base = super()._create_draft_vllm_config()
        # CA's first pass is non-causal: pick a backend that supports it (as vLLM's DFlash does)
        return replace(base, attention_config=replace(base.attention_config, use_non_causal=True))

    # -- model: the drafter, the target's shared modules and the layers it taps ------------------
    def moa_model(self) -> MoADraftModel:
        return self.model.unwrap() if hasattr(self.model, "unwrap") else self.model

    def model_returns_tuple(self) -> bool:
        return False

    def _maybe_share_embeddings(self, target_language_model: nn.Module) -> None:
        self.moa_model().model.embed_tokens = target_language_model.model.embed_tokens

    def _maybe_share_lm_head(self, target_language_model: nn.Module) -> None:
        model = self.moa_model()
        model.lm_head = target_language_model.lm_head
        if model.config.tli > 0:  # the target's own last TLI decoder layers and final norm
            layers = target_layers.tli_decoder_layers(target_language_model, model.config.tli)
            model.model.target_tail = (layers, target_language_model.model.norm)
            self._tli_layer_names = [layer.self_attn.attn.layer_name for layer in layers]

    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)  # builds MoADraftModel, finds the draft attention layers
        model = self.moa_model()
        self._ca_layer_names = {model.model.ca.attn.layer_name}
        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)  # type: ignore[type-abstract]
        self._target_layers = target_layers.target_attention_layers(
            layers, self._draft_attn_layer_names, model.config.target_signature, extract_layer_index)

    def initialize_attn_backend(self, kv_cache_config: KVCacheConfig,
                                kernel_block_sizes: list[int] | None = None) -> None:
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        group = kv_cache_config.kv_cache_groups[self.kv_cache_gid]
        self._kv_layout, backend = target_layers.kv_layout_of(self._target_layers, group, self.kv_cache_gid,
                                                              self.trees is not None)
        if self.trees is not None:
            self.trees.attach(self._target_layers)
        logger.info("MoA drafter: tapping %d target layers (%s KV cache, block size %d, KV-cache group %d)",
                    len(self._target_layers), backend, self.block_size, self.kv_cache_gid)

    # -- a step -------------------------------------------------------------------------------
    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,  # [N]
        target_positions: torch.Tensor,  # [N]
        target_hidden_states: torch.Tensor,  # [N, E] the target's output (rows may read it)
        next_token_ids: torch.Tensor,  # [B]
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: CommonAttentionMetadata,
        sampling_metadata: Any,
        mm_embed_inputs: Any = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,  # [B]
        slot_mappings: Any = None,
    ) -> torch.Tensor:
        cad, view = common_attn_metadata, RunnerView(self._runner)
        # 1. a step without drafts: mark its slots stale (catch_up.py)
        if num_speculative_tokens == 0:
            skipped = self.skip_draftless_step(cad, target_positions.shape[0])
            if skipped is not None:
                return skipped
        needs_layout = self.trees is not None or self.lookups is not None or self.stale_slots.any
        starts = compat.host_query_start_loc(cad) if needs_layout else []  # [B + 1] host
        # 2. the tree's shape for this step (first: chain_if_faster times steps)
        tree_spec = None if self.trees is None else self.trees.step_spec(view, starts, num_rejected_tokens_gpu)
        # 3. the tap: catch up on skipped steps, then the verified tokens' CA rows
        if self.stale_slots.any:
            catch_up.catch_up(self.stale_slots, self.moa_model(), view, self._target_caches(), self._kv_layout,
                              self.block_size, cad.block_table_tensor, starts, target_positions)
        self.write_verified_rows(target_positions, cad, num_rejected_tokens_gpu, target_hidden_states, target_token_ids)
        # 4. lookup drafts (lookup_drafts.py): the requests that draft from lookup this step
        lookups = None if self.lookups is None else self.lookups.plan(
            view, target_token_ids, next_token_ids, starts, num_rejected_tokens_gpu, num_speculative_tokens)
        # a tree engine scheduled no more drafts than its depth drafts the chain (tree_drafts.py)
        chains = self.trees is None or self.trees.drafts_chain(num_speculative_tokens)
        drafting_steps = num_speculative_tokens if chains else min(1, num_speculative_tokens)
        if lookups is not None and lookups.every_row:
            drafting_steps = 0  # the first pass only: it keeps SA's KV cache in step (as vLLM's dynamic K=0)
        # 5. vLLM's draft-model loop: the first pass (+ K - 1 chain steps)
        self._num_rejected = num_rejected_tokens_gpu
        try:
            first_pass = super().propose(
                drafting_steps, target_token_ids, target_positions, target_hidden_states, next_token_ids,
                token_indices_to_sample, cad, sampling_metadata, mm_embed_inputs=mm_embed_inputs,
                num_rejected_tokens_gpu=num_rejected_tokens_gpu, slot_mappings=slot_mappings,
            )  # [B, K] (a chain), [B, 1] after the first pass that a tree grows from, or [B, 0]
            # 6. chains (with lookup rows in place), or trees grown from the first pass
            if chains:
                if lookups is None:
                    return first_pass
                drafts, self._last_draft_probs = self.lookups.chains(
                    first_pass, lookups, num_speculative_tokens, self._last_draft_probs, next_token_ids.device)
                return drafts
            # tree nodes are deterministic top-k children (point masses): no draft distribution for
            # vLLM's rejection sampler, which verifies the steps that fall back to chains
            self._last_draft_probs = None
            if num_speculative_tokens == 0:  # K = 0 with VLLM_MOA_CATCH_UP=0: the first pass alone
                return first_pass
            return self.grow_trees(next_token_ids, num_speculative_tokens, lookups, tree_spec, view.req_ids)
        finally:
            self._num_rejected = None
            self._root_hidden = None

    def skip_draftless_step(self, common_attn_metadata: CommonAttentionMetadata, num_tokens: int) -> torch.Tensor | None:
        """A step that schedules no drafts for the next one: its first `num_tokens` slots marked
        stale (catch_up.py) -> no drafts [B, 0]; None where steps are not skipped (the drafter's
        rows read the target's final hidden states, or VLLM_MOA_CATCH_UP=0). Also the hook of
        RunnerProposePatch (runner_propose.py), which then skips vLLM's preparation of the
        drafter's inputs."""
        if not catch_up.skips_steps(self.moa_model().lsa):
            return None
        slots = common_attn_metadata.slot_mapping[:num_tokens]
        catch_up.skip_step(self.stale_slots, self.moa_model().model.sa.attn.kv_cache, self._kv_layout, slots)
        self._last_draft_probs = None
        return torch.empty(common_attn_metadata.num_reqs, 0, dtype=torch.long, device=slots.device)

    def write_verified_rows(self, positions: torch.Tensor, cad: CommonAttentionMetadata,
                            num_rejected: torch.Tensor | None, hidden_states: torch.Tensor | None = None,
                            token_ids: torch.Tensor | None = None) -> None:
        """The tap: CA rows for the step's scheduled tokens, at their own slots (from their KV, and
        their final hidden states [N, E] where the drafter's rows read them)."""
        if positions.dim() != 1:
            raise UnsupportedMoASetup("MoA drafts for text targets with 1-D positions (no M-RoPE)")
        num_tokens = positions.shape[0]
        slots = cad.slot_mapping[:num_tokens]  # where the target just wrote their KV
        write = tap_write_slots(cad.query_start_loc, slots, num_rejected)
        final = None if hidden_states is None else hidden_states[:num_tokens]
        ids = None if token_ids is None else token_ids[:num_tokens]
        self.moa_model().write_rows(self._target_caches(), self._kv_layout, slots, positions, write, final, ids)
        self.stale_slots.mark_fresh(write)

    def _target_caches(self) -> list[torch.Tensor]:
        return [layer.kv_cache for layer in self._target_layers]

    # -- draft trees (tree_drafts.py) ----------------------------------------------------------
    def grow_trees(self, next_token_ids: torch.Tensor, count: int, lookups: Any, spec: Any,
                   req_ids: list[str | None]) -> torch.Tensor:
        """The step's trees from the first pass -> their first `count` nodes in preorder [B, count]."""
        model, context, root_positions = self.moa_model(), None, []
        if lookups is None or not lookups.every_row:
            root_positions = self.positions[self._sample_indices].tolist()  # [B]
            sa_metadata = self._first_pass_metadata[model.model.sa.attn.layer_name]
            context = tree_levels.tree_context(model, self._kv_layout, sa_metadata.block_table, root_positions)
        return self.trees.grow(model, context, self._root_hidden, root_positions, next_token_ids, count, lookups,
                               spec, req_ids)

    def plan_tree_step(self, runner: Any, scheduler_output: Any) -> None:
        """RunnerPrepareInputsPatch's hook: this step's trees."""
        if self.trees is not None:
            self.trees.plan(RunnerView(runner), scheduler_output,
                            frozenset(layer.layer_name for layer in self._target_layers), self._kv_layout)

    def verify_metadata(self, spec_decode_metadata: Any) -> Any:
        """RunnerSamplePatch's hook: what vLLM's `_sample` sees. A step in which no request has
        drafts is sampled by vLLM's own sampler (None), as in an engine without speculation,
        instead of its rejection sampler over zero draft rows (runner_sample.py); with
        VLLM_MOA_PLAIN_SAMPLER=0, as vLLM does."""
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0 and envs.VLLM_MOA_PLAIN_SAMPLER:
            return None
        return spec_decode_metadata

    def accept_tree_step(self, runner: Any, logits: torch.Tensor, spec_decode_metadata: Any, sampler_output: Any) -> None:
        """RunnerSamplePatch's hook: accept along this step's trees."""
        if self.trees is not None:
            view = RunnerView(runner)
            self.trees.accept(view, logits, spec_decode_metadata, sampler_output, self._target_caches(),
                              view.slot_mapping(self.kv_cache_gid))

    # -- vLLM's draft loop, with CA's metadata and slots ---------------------------------------
    def set_inputs_first_pass(self, target_token_ids, next_token_ids, target_positions, target_hidden_states,
                              token_indices_to_sample, cad, num_rejected_tokens_gpu):
        num_tokens, token_indices_to_sample, cad = super().set_inputs_first_pass(
            target_token_ids, next_token_ids, target_positions, target_hidden_states, token_indices_to_sample,
            cad, num_rejected_tokens_gpu)
        self._sample_indices = token_indices_to_sample  # [B]: the TLI layers write there only
        return num_tokens, token_indices_to_sample, cad

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        if self.trees is not None:  # the first pass's output at each request's root [B, E]
            self._root_hidden = hidden_states
        return super()._sample_draft_tokens(hidden_states, sampling_metadata)

    def build_per_group_and_layer_attn_metadata(
        self, common_attn_metadata: CommonAttentionMetadata, draft_index: int = 0
    ) -> tuple[list[object], dict[str, object]]:
        per_group, per_layer = super().build_per_group_and_layer_attn_metadata(common_attn_metadata, draft_index)
        if draft_index == 0:
            self._first_pass_metadata = per_layer  # tree levels read SA's block table from it
        draft_attention.set_ca_and_tli_metadata(
            per_layer, common_attn_metadata, draft_index, self._num_rejected, self.draft_attn_groups,
            self._ca_layer_names, self._tli_layer_names, self._draft_attn_layer_names,
            self.moa_model().config.attention_window)
        return per_group, per_layer

    def _get_slot_mapping(self, num_tokens: int, slot_mapping: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        mapping = super()._get_slot_mapping(num_tokens, slot_mapping)
        return draft_attention.drafter_slot_mapping(mapping, self._ca_layer_names, self._tli_layer_names,
                                                    first_pass=slot_mapping is not None,
                                                    sample_indices=self._sample_indices)
