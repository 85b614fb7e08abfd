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
    3. draft trees (speculative_config "moa_tree", integration/tree.py) and lookup drafts beside
       the model's ("moa_retrieval", integration/retrieval.py);
    4. chains skip steps that vLLM schedules without drafts (dynamic K = 0) and catch up when
       drafting resumes (integration/catch_up.py; VLLM_MOA_CATCH_UP=0 runs vLLM's first pass
       at every step instead).
The embedding and LM head are the target's own modules (shared, never copied).
"""

from __future__ import annotations

import inspect
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
from vllm_moa.decoding.tree import TreeGrowth
from vllm_moa.integration import compat, tensor_parallel, tree
from vllm_moa.integration.catch_up import StaleSlots, chunks
from vllm_moa.integration.draft_config import (
    TREE_FIELD,
    UnsupportedMoASetup,
    check_kv_cache_dtype,
    check_tree_setup,
    requested_chain_if_faster,
    requested_retrieval,
    requested_tree,
)
from vllm_moa.integration.model import MoADraftModel
from vllm_moa.integration.retrieval import (
    LookupPlan,
    lookup_chain,
    lookup_tree,
    one_hot_rows,
    plan_lookups,
    request_histories,
)
from vllm_moa.integration.tap import PAD_SLOT, row_seq_lens, tap_write_slots
from vllm_moa.integration.tree_or_chain import TreeOrChain
from vllm_moa.kernels.paged import split_kv_cache

logger = init_logger(__name__)


class MoAProposer(DraftModelProposer):
    """vLLM's draft-model proposer for MoADraftModel, with the tap (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None) -> None:
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        check_kv_cache_dtype(vllm_config.cache_config.cache_dtype, dtype)
        self._target_layers: list[nn.Module] = []
        self._ca_layer_names: set[str] = set()
        self._kv_layout: compat.KVLayout | None = None
        self._num_rejected: torch.Tensor | None = None  # [B] of the step being drafted
        self._tli_layer_names: list[str] = []  # TLI > 0: the target attention layers the drafter runs
        self._sample_indices: torch.Tensor | None = None  # [B] first pass: each request's drafting token
        # draft trees (integration/tree.py): the shape asked for in speculative_config.moa_tree
        self._runner = runner
        spec = vllm_config.speculative_config
        self.tree_spec = requested_tree(spec)
        self.drafted_trees = tree.DraftedTrees()
        self._first_pass_metadata: dict[str, object] = {}
        self._root_hidden: torch.Tensor | None = None  # [B, E] tree mode: the first pass's output at the roots
        self._chain_only_reason: str | None = None  # logged when it changes
        self.retrieval = requested_retrieval(spec)  # lookup drafts beside the model's (None: off)
        self.rounds = {"model": 0, "retrieval": 0}  # request-steps drafted by each (with retrieval on)
        self.stale_slots = StaleSlots()  # slots of steps skipped at K = 0 (integration/catch_up.py)
        self.tree_or_chain = None  # moa_tree.chain_if_faster: each step the tree or the chain of its budget
        if self.tree_spec is not None:  # the tree patches are applied (patches.prepare_moa_engine)
            check_tree_setup(spec, vllm_config.kv_transfer_config)
            if requested_chain_if_faster(spec):
                self.tree_or_chain = TreeOrChain(self.tree_spec, spec.num_speculative_tokens)

    def _create_draft_vllm_config(self) -> VllmConfig:
        base = super()._create_draft_vllm_config()
        # CA's first pass is non-causal: pick a backend that supports it (as vLLM's DFlash does)
        return replace(base, attention_config=replace(base.attention_config, use_non_causal=True))

    # -- model ------------------------------------------------------------------------------
    def moa_model(self) -> MoADraftModel:
        model = self.model
        return model.unwrap() if hasattr(model, "unwrap") else model

    def model_returns_tuple(self) -> bool:
        return False

    def _maybe_share_embeddings(self, target_language_model: nn.Module) -> None:
        self.moa_model().model.embed_tokens = target_language_model.model.embed_tokens

    def _maybe_share_lm_head(self, target_language_model: nn.Module) -> None:
        model = self.moa_model()
        model.lm_head = target_language_model.lm_head
        tli = model.config.tli
        if tli > 0:  # the target's own last TLI decoder layers and final norm (shared, never copied)
            layers = tuple(target_language_model.model.layers[-tli:])
            for layer in layers:
                params = list(inspect.signature(layer.forward).parameters)
                if params[:3] != ["positions", "hidden_states", "residual"]:
                    raise UnsupportedMoASetup(
                        f"TLI={tli} runs the target's decoder layers as (positions, hidden_states, residual); "
                        f"{type(layer).__name__}.forward takes {params}")
            model.model.target_tail = (layers, target_language_model.model.norm)
            self._tli_layer_names = [layer.self_attn.attn.layer_name for layer in layers]

    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)  # builds MoADraftModel, finds the draft attention layers
        model = self.moa_model()
        self._ca_layer_names = {model.model.ca.attn.layer_name}
        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)  # type: ignore[type-abstract]
        target_names = sorted(set(layers) - self._draft_attn_layer_names, key=extract_layer_index)
        sig = model.config.target_signature
        if len(target_names) != sig.num_layers:
            raise UnsupportedMoASetup(
                f"the drafter was trained on {sig.num_layers} target layers; vLLM's target has "
                f"{len(target_names)} attention layers ({target_names[:3]}...)"
            )
        tp = tensor_parallel.tp_size()
        kv_heads = tensor_parallel.local_kv_heads(sig.num_kv_heads, tp)  # this rank's share (the tap gathers)
        for name in target_names:
            layer = layers[name]
            if (layer.num_kv_heads, layer.head_size) != (kv_heads, sig.head_dim):
                raise UnsupportedMoASetup(
                    f"target layer {name} has {layer.num_kv_heads} KV heads of {layer.head_size} on this rank; "
                    f"the drafter needs {kv_heads} of {sig.head_dim} (the target's {sig.num_kv_heads} "
                    f"at tensor_parallel_size={tp})"
                )
        self._target_layers = [layers[name] for name in target_names]

    def initialize_attn_backend(self, kv_cache_config: KVCacheConfig,
                                kernel_block_sizes: list[int] | None = None) -> None:
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        target_names = {layer.layer_name for layer in self._target_layers}
        group = kv_cache_config.kv_cache_groups[self.kv_cache_gid]
        if not target_names <= set(group.layer_names):
            raise UnsupportedMoASetup(
                "MoA addresses the target's KV cache with the drafter's block table, so every target "
                "attention layer must share the drafter's KV-cache group; vLLM split them "
                f"(drafter group {self.kv_cache_gid}: {sorted(group.layer_names)[:4]}...)"
            )
        backends = {layer.get_attn_backend().get_name() for layer in self._target_layers}
        if len(backends) != 1:
            raise UnsupportedMoASetup(f"target layers run on several attention backends: {sorted(backends)}")
        backend = backends.pop()
        if self.tree_spec is not None:
            if backend not in tree.TREE_BACKENDS:
                raise UnsupportedMoASetup(
                    f"draft trees ({TREE_FIELD}) are verified with the {', '.join(tree.TREE_BACKENDS)} attention "
                    f"backend so far; this target runs on {backend} (drop {TREE_FIELD} to draft chains)")
            for layer in self._target_layers:
                for feature in ("logits_soft_cap", "sinks", "alibi_slopes"):
                    if getattr(layer.impl, feature, None):
                        raise UnsupportedMoASetup(
                            f"draft trees ({TREE_FIELD}): the tree mask does not apply the target's {feature} "
                            f"(layer {layer.layer_name}); drop {TREE_FIELD} to draft chains")
        isas = {getattr(layer, "isa", None) for layer in self._target_layers}  # CPU_ATTN's kernel choice
        self._kv_layout = compat.kv_layout_for_backend(backend, isas.pop() if len(isas) == 1 else None)
        logger.info("MoA drafter: tapping %d target layers (%s KV cache, block size %d, KV-cache group %d)",
                    len(self._target_layers), backend, self.block_size, self.kv_cache_gid)

    # -- drafting ---------------------------------------------------------------------------
    def set_inputs_first_pass(self, target_token_ids, next_token_ids, target_positions, target_hidden_states,
                              token_indices_to_sample, cad, num_rejected_tokens_gpu):
        num_tokens, token_indices_to_sample, cad = super().set_inputs_first_pass(
            target_token_ids, next_token_ids, target_positions, target_hidden_states, token_indices_to_sample,
            cad, num_rejected_tokens_gpu)
        self._sample_indices = token_indices_to_sample  # [B]: the TLI layers write there only
        return num_tokens, token_indices_to_sample, cad

    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,  # [N]
        target_positions: torch.Tensor,  # [N]
        target_hidden_states: torch.Tensor,  # [N, E] the target's output (read with config final_hidden_rows)
        next_token_ids: torch.Tensor,  # [B]
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: CommonAttentionMetadata,
        sampling_metadata: Any,
        mm_embed_inputs: Any = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,  # [B]
        slot_mappings: Any = None,
    ) -> torch.Tensor:
        if num_speculative_tokens == 0 and self.skips_steps_without_drafts():
            return self.skip_step(common_attn_metadata, target_positions.shape[0], next_token_ids)
        step_spec = self.step_tree_spec(common_attn_metadata, num_rejected_tokens_gpu)  # first: it times steps
        if self.stale_slots.any:
            self.catch_up(common_attn_metadata, target_positions)
        self.write_verified_rows(target_positions, common_attn_metadata, num_rejected_tokens_gpu, target_hidden_states,
                                 target_token_ids)
        self._num_rejected = num_rejected_tokens_gpu
        lookups = self.plan_lookups(target_token_ids, next_token_ids, common_attn_metadata, num_rejected_tokens_gpu,
                                    num_speculative_tokens)
        drafting_steps = 1 if self.tree_spec is not None else num_speculative_tokens
        if lookups is not None and lookups.every_row:
            drafting_steps = 0  # the first pass only: it keeps SA's KV cache in step (as vLLM's dynamic K=0)
        try:
            first_pass = super().propose(
                drafting_steps, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, token_indices_to_sample, common_attn_metadata,
                sampling_metadata, mm_embed_inputs=mm_embed_inputs, num_rejected_tokens_gpu=num_rejected_tokens_gpu,
                slot_mappings=slot_mappings,
            )  # [B, K] (a chain), [B, 1] after the first pass that a tree grows from, or [B, 0]
            if self.tree_spec is None:
                return self.chains_with_lookups(first_pass, lookups, num_speculative_tokens, next_token_ids.device)
            # tree nodes are deterministic top-k children (point masses): no draft distribution
            # for vLLM's rejection sampler, which verifies the steps that fall back to chains
            self._last_draft_probs = None
            return self.propose_trees(next_token_ids, num_speculative_tokens, lookups, step_spec)
        finally:
            self._num_rejected = None
            self._root_hidden = None

    # -- steps without drafts (integration/catch_up.py) -------------------------------------
    def skips_steps_without_drafts(self) -> bool:
        """Chains skip K = 0 steps unless VLLM_MOA_CATCH_UP=0; not trees (their first pass feeds the
        tree levels) and not drafters whose CA rows carry the target's final hidden states (a
        skipped step's are gone)."""
        return (bool(envs.VLLM_MOA_CATCH_UP) and self.tree_spec is None
                and not self.moa_model().config.final_hidden_rows)

    def skip_step(self, cad: CommonAttentionMetadata, num_tokens: int, next_token_ids: torch.Tensor) -> torch.Tensor:
        """K = 0: neither the tap nor the first pass; the step's slots are stale until a step drafts."""
        if not self.stale_slots.any:  # the first skipped step: size the flags once
            k_cache = split_kv_cache(self.moa_model().model.sa.attn.kv_cache, self._kv_layout)[0]
            self.stale_slots.allocate(k_cache.shape[0] * k_cache.shape[1], k_cache.device)
        self.stale_slots.mark_stale(cad.slot_mapping[:num_tokens])
        self._last_draft_probs = None
        return torch.empty(next_token_ids.shape[0], 0, dtype=torch.long, device=next_token_ids.device)

    def catch_up(self, cad: CommonAttentionMetadata, positions: torch.Tensor) -> None:
        """Before a step drafts: SA's K/V and CA's rows of the batch's stale tokens, from the tokens
        and the target's cache, as the skipped steps would have written them."""
        starts_at = compat.host_query_start_loc(cad)  # [B + 1]
        batch = len(starts_at) - 1
        first = positions[torch.tensor(starts_at[:-1]).clamp(max=max(positions.shape[0] - 1, 0))].tolist()
        starts = [first[b] if starts_at[b + 1] > starts_at[b] else 0 for b in range(batch)]
        rows, at, slots = self.stale_slots.stale_before(cad.block_table_tensor[:batch], self.block_size, starts)
        if slots.numel() == 0:
            return
        tokens = compat.RunnerView(self._runner).token_ids_at(rows, at).to(slots.device)  # [M]
        model = self.moa_model()
        caches = [layer.kv_cache for layer in self._target_layers]
        for part in chunks(slots.shape[0]):
            model.write_sa_keys_values(tokens[part], at[part], slots[part])
            model.write_rows(caches, self._kv_layout, slots[part], at[part], slots[part], None, tokens[part])
        self.stale_slots.mark_caught_up(slots)

    # -- lookup drafts (integration/retrieval.py) -------------------------------------------
    def plan_lookups(self, step_tokens: torch.Tensor, next_token_ids: torch.Tensor, cad: CommonAttentionMetadata,
                     num_rejected: torch.Tensor | None, count: int) -> LookupPlan | None:
        """Which requests draft from lookup this step (None: retrieval is off)."""
        if self.retrieval is None:
            return None
        view = compat.RunnerView(self._runner)
        batch = next_token_ids.shape[0]
        histories = request_histories(
            [view.verified_token_ids(b) for b in range(batch)], [view.scheduled_draft_count(b) for b in range(batch)],
            step_tokens.tolist(), compat.host_query_start_loc(cad)[: batch + 1],
            None if num_rejected is None else num_rejected.tolist())
        length = count  # a tree's lookup paths may be as deep as its budget
        alone_at = count if self.tree_spec is None else self.tree_spec.depth
        plan = plan_lookups(self.retrieval, histories, next_token_ids.tolist(), length, alone_at)
        drafted = len(plan.rows)
        self.rounds["retrieval"] += drafted
        self.rounds["model"] += batch - drafted
        return plan

    def chains_with_lookups(self, drafts: torch.Tensor, lookups: LookupPlan | None, count: int,
                            device: torch.device) -> torch.Tensor:
        """The model's chains [B, K] with the lookup rows' chains in their place."""
        if lookups is None or not lookups.rows:
            return drafts
        chains = torch.tensor([lookup_chain(found, count) if found is not None else [0] * count
                               for found in lookups.found], dtype=torch.long)  # [B, K]
        if lookups.every_row:
            self._last_draft_probs = None
            return chains.to(device)
        drafts = drafts.clone()
        rows = lookups.rows
        drafts[rows] = chains[rows].to(drafts.device, drafts.dtype)
        if self._last_draft_probs is not None:  # q of the model's sampled chains: lookup rows are point masses
            one_hot_rows(self._last_draft_probs, rows, chains)
        return drafts

    # -- draft trees ------------------------------------------------------------------------
    def step_tree_spec(self, cad: CommonAttentionMetadata, num_rejected: torch.Tensor | None):
        """This step's shape: the tree asked for, or with chain_if_faster the tree or the chain of
        its budget, whichever measures faster (integration/tree_or_chain.py); None for chains."""
        if self.tree_or_chain is None:
            return self.tree_spec
        starts = compat.host_query_start_loc(cad)
        return self.tree_or_chain.next_spec(
            list(compat.RunnerView(self._runner).req_ids[: len(starts) - 1]),
            [hi - lo for lo, hi in zip(starts, starts[1:])], None if num_rejected is None else num_rejected.tolist())

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        if self.tree_spec is not None:  # the first pass's output at each request's root [B, E]
            self._root_hidden = hidden_states
        return super()._sample_draft_tokens(hidden_states, sampling_metadata)

    def propose_trees(self, next_token_ids: torch.Tensor, count: int, lookups: LookupPlan | None = None,
                      spec: Any = None) -> torch.Tensor:
        """Grow an EAGLE-2 tree (`spec`, by default the tree asked for) per request from the first pass (decoding/tree.py's TreeGrowth,
        all requests' levels in one drafter forward), or take the request's lookup tree
        (integration/retrieval.py); returns the first `count` (vLLM's tokens to schedule: the
        budget) of each tree's nodes in preorder, [B, count], for the scheduler and keeps the
        trees for verification."""
        model = self.moa_model()
        spec = spec or self.tree_spec
        roots = next_token_ids.tolist()  # [B]
        batch = len(roots)
        device = next_token_ids.device
        grown = [b for b in range(batch) if lookups is None or lookups.found[b] is None]
        growths = {b: TreeGrowth(roots[b], spec, None, None, device) for b in grown}
        if grown:
            root_positions = self.positions[self._sample_indices].tolist()  # [B]
            sa_metadata = self._first_pass_metadata[model.model.sa.attn.layer_name]
            context = model.tree_context(self._kv_layout, sa_metadata.block_table, root_positions)
            root_logits = model.compute_logits(self._root_hidden[grown])  # [G, V]
            for i, b in enumerate(grown):
                growths[b].next_level()
                growths[b].advance(root_logits[i: i + 1])
        while growths:
            pending = [(b, level) for b, growth in growths.items() if (level := growth.next_level()) is not None]
            if not pending:
                break
            ids, positions, levels, start = [], [], [], 0
            for b, (tokens, depths, _, visible) in pending:
                ids.append(tokens)
                positions += [root_positions[b] + depth for depth in depths]
                levels.append((b, slice(start, start + len(depths)), visible))
                start += len(depths)
            logits = model.tree_level(context, torch.cat(ids), torch.tensor(positions, device=device), levels)
            for b, rows, _ in levels:
                growths[b].advance(logits[rows])
        drafts = torch.empty(batch, count, dtype=torch.long)
        req_ids = compat.RunnerView(self._runner).req_ids
        for b in range(batch):
            grew = growths[b].result() if b in growths else lookup_tree(roots[b], lookups.found[b], spec.budget)
            drafted = tree.preorder(tree.pad_tree(grew, spec.budget))
            drafts[b] = drafted.tokens[1: count + 1]
            if b < len(req_ids) and req_ids[b] is not None:
                self.drafted_trees.by_request[req_ids[b]] = drafted
        self.drafted_trees.forget_all_but(set(req_ids))
        return drafts.to(device)

    def plan_tree_step(self, runner, scheduler_output) -> None:
        """RunnerPrepareInputsPatch's hook: this step's trees (tree.plan_step)."""
        if self.tree_spec is None:
            return
        view = compat.RunnerView(runner)
        reason = tree.chain_only_reason(view.sampling_metadata, scheduler_output.has_structured_output_requests,
                                        view.logprobs_mode)
        if reason is not None:
            if reason != self._chain_only_reason:
                logger.info("MoA draft trees: verified as chains while the batch uses %s", reason)
            self._chain_only_reason = reason
            tree.set_active(None)
            return
        tree.set_active(tree.plan_step(
            self.drafted_trees, scheduler_output.scheduled_spec_decode_tokens, view.req_id_to_index,
            view.query_start_loc(), view.num_computed_tokens(),
            view.positions, frozenset(layer.layer_name for layer in self._target_layers), self._kv_layout,
        ))

    def accept_tree_step(self, runner, logits, spec_decode_metadata, sampler_output) -> None:
        """RunnerSamplePatch's hook: accept along this step's trees (tree.TreeStep.accept)."""
        step = tree.take_active()
        if step is None or spec_decode_metadata is None:
            return
        view = compat.RunnerView(runner)
        step.accept(
            logits, spec_decode_metadata.cu_num_sampled_tokens, view.sampling_metadata,
            sampler_output.sampled_token_ids, [layer.kv_cache for layer in self._target_layers],
            view.slot_mapping(self.kv_cache_gid), view.input_ids,
            view.positions, sampler_output.logprobs_tensors, view.logprobs_mode,
        )

    def write_verified_rows(self, positions: torch.Tensor, cad: CommonAttentionMetadata,
                            num_rejected: torch.Tensor | None, hidden_states: torch.Tensor | None = None,
                            token_ids: torch.Tensor | None = None) -> None:
        """The tap: CA rows for the step's scheduled tokens, at their own slots (from their KV, and
        their final hidden states [N, E] with config final_hidden_rows)."""
        if positions.dim() != 1:
            raise UnsupportedMoASetup("MoA drafts for text targets with 1-D positions (no M-RoPE)")
        slots = cad.slot_mapping[: positions.shape[0]]  # where the target just wrote their KV
        write = tap_write_slots(cad.query_start_loc, slots, num_rejected)
        caches = [layer.kv_cache for layer in self._target_layers]
        final = None if hidden_states is None else hidden_states[: positions.shape[0]]
        ids = None if token_ids is None else token_ids[: positions.shape[0]]
        self.moa_model().write_rows(caches, self._kv_layout, slots, positions, write, final, ids)
        self.stale_slots.mark_fresh(write)

    def build_per_group_and_layer_attn_metadata(
        self, common_attn_metadata: CommonAttentionMetadata, draft_index: int = 0
    ) -> tuple[list[object], dict[str, object]]:
        per_group, per_layer = super().build_per_group_and_layer_attn_metadata(common_attn_metadata, draft_index)
        if draft_index == 0:
            self._first_pass_metadata = per_layer  # tree levels read SA's block table from it
        rejected = self._num_rejected
        rows_cad = common_attn_metadata.replace(
            seq_lens=row_seq_lens(common_attn_metadata.seq_lens, draft_index, rejected),
            causal=draft_index > 0,  # first pass: every query sees all R rows
            **compat.host_seq_lens_fields(common_attn_metadata, lambda lens: row_seq_lens(lens, draft_index),
                                          exact=rejected is None),
        )
        for group in self.draft_attn_groups:
            names = self._ca_layer_names.intersection(group.layer_names)
            if not names:
                continue
            metadata = compat.build_drafting_metadata(group, rows_cad, draft_index)
            if draft_index == 0 and getattr(metadata, "causal", False) is not False:
                raise UnsupportedMoASetup(
                    f"MoA's cross-attention needs a non-causal-capable attention backend; the drafter "
                    f"runs on {group.backend.get_name()} (use FLASH_ATTN, TRITON_ATTN, FLASHINFER or CPU_ATTN)"
                )
            for name in names:
                per_layer[name] = metadata
        if self._tli_layer_names:  # the target's TLI layers attend like SA: causal, the full sequence
            sa_metadata = next(per_layer[name] for name in self._draft_attn_layer_names
                               if name not in self._ca_layer_names)
            for name in self._tli_layer_names:
                per_layer[name] = sa_metadata
        return per_group, per_layer

    def _get_slot_mapping(self, num_tokens: int, slot_mapping: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        mapping = super()._get_slot_mapping(num_tokens, slot_mapping)
        for name in self._ca_layer_names:  # CA's cache is written by the tap only
            mapping.pop(name, None)
        if self._tli_layer_names:
            # the target's TLI layers write predicted K/V at drafted positions only: in the first
            # pass (slot_mapping given) at each request's drafting token, never at verified ones
            draft_slots = next(iter(mapping.values()))  # [num_tokens], SA's
            if slot_mapping is not None and self._sample_indices is not None:
                only = torch.full_like(draft_slots, PAD_SLOT)
                only[self._sample_indices] = draft_slots[self._sample_indices]
                draft_slots = only
            for name in self._tli_layer_names:
                mapping[name] = draft_slots
        return mapping
