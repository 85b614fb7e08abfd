"""Draft trees inside vLLM, the proposer's side (speculative_config "moa_tree"): each step's shape,
the trees grown from the first pass, and the hooks that hand them to verification.

    step_spec   this step's shape: the tree asked for, or with chain_if_faster the tree or the
                chain of its budget, whichever measures faster (tree_or_chain.py)
    drafts_chain  a step scheduled no more drafts than the tree's depth drafts the chain instead
    grow        an EAGLE-2 tree per request (decoding/tree.py's TreeGrowth, all requests' levels
                in one drafter forward: tree_levels.py), or the request's
                lookup tree (lookup_drafts.py); the first `count` nodes in preorder go to the
                scheduler, the trees stay here for verification (`drafted`)
    plan        the runner's _prepare_inputs hook: this step's TreeStep (tree_verification.py),
                which TreeAttentionPatch applies in the target's layers while it is `step_in_flight`
    accept      the runner's _sample hook: acceptance along the step's trees

The step in flight lives on this object, which the proposer owns and sets on the target's
attention layers (compat.TREE_VERIFIER_ATTR): no module-level state is shared between patches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vllm_moa.decoding.tree import DraftSpec, TreeGrowth
from vllm_moa.integration.moa import tree_levels
from vllm_moa.integration.moa import tree_verification as verification
from vllm_moa.integration.moa.lookup_drafts import LookupPlan, lookup_tree
from vllm_moa.integration.moa.tree_or_chain import TreeOrChain
from vllm_moa.integration.shell import compat
from vllm_moa.integration.shell.draft_config import (
    check_tree_graphs,
    check_tree_setup,
    requested_chain_if_faster,
    requested_tree,
)
from vllm_moa.integration.shell.runner_view import RunnerView

LayerFirstPass = dict[str, Any]  # the first pass's attention metadata by layer name


class TreeDrafting:
    """One proposer's draft trees: shape per step, growth, and the step being verified."""

    def __init__(self, spec: DraftSpec, budget: int, chain_if_faster: bool, logger: Any) -> None:
        self.spec = spec
        self.drafted = verification.DraftedTrees()
        self.tree_or_chain = TreeOrChain(spec, budget) if chain_if_faster else None
        self.step_in_flight: verification.TreeStep | None = None  # read by TreeAttentionPatch
        self._chain_only_reason: str | None = None  # logged when it changes
        self._logger = logger

    @classmethod
    def for_engine(cls, vllm_config: Any, device: torch.device, logger: Any) -> TreeDrafting | None:
        """The engine's draft trees (speculative_config.moa_tree), checked against what it runs with,
        or None when it drafts chains (the tree patches are applied: patches.prepare_moa_engine)."""
        spec = vllm_config.speculative_config
        tree = requested_tree(spec)
        if tree is None:
            return None
        check_tree_setup(spec, vllm_config.kv_transfer_config)
        if device.type != "cpu":  # vLLM's CPU engine captures no graphs
            check_tree_graphs(vllm_config.compilation_config.cudagraph_mode)
        return cls(tree, spec.num_speculative_tokens, requested_chain_if_faster(spec), logger)

    def attach(self, target_layers: list[Any]) -> None:
        """Let TreeAttentionPatch find this object on the target's attention layers."""
        for layer in target_layers:
            setattr(layer, compat.TREE_VERIFIER_ATTR, self)

    def drafts_chain(self, count: int) -> bool:
        """Whether a step scheduled `count` drafts per request drafts a chain instead of a tree: a
        cut to no more nodes than the tree's depth keeps only its best path, which the chain loop
        drafts without growing the other nodes and vLLM verifies as a chain (K by measured speed
        falls back to it: adaptive_k.py). The trees of earlier steps are dropped, so that no
        step verifies a stale one."""
        if not 0 < count <= min(self.spec.depth, self.spec.budget - 1):
            return False
        self.drafted.forget_all_but(set())
        return True

    def step_spec(self, view: RunnerView, query_start_loc: list[int], num_rejected: Tensor | None) -> DraftSpec:
        if self.tree_or_chain is None:
            return self.spec
        return self.tree_or_chain.next_spec(
            list(view.req_ids[: len(query_start_loc) - 1]),
            [hi - lo for lo, hi in zip(query_start_loc, query_start_loc[1:])],
            None if num_rejected is None else num_rejected.tolist())

    def grow(self, model: Any, context: Any, root_hidden: Tensor, root_positions: list[int],
             next_token_ids: Tensor, count: int, lookups: LookupPlan | None, spec: DraftSpec | None,
             req_ids: list[str | None]) -> Tensor:
        """Trees from the first pass's outputs at the roots, root_hidden [B, E] (or the lookup
        trees) -> the first `count` nodes of each tree in preorder, [B, count].

        model: the MoADraftModel; context: tree_levels.tree_context(...) of the step (None when every
        request takes its lookup tree); root_positions [B]: the roots' positions."""
        spec = spec or self.spec
        roots = next_token_ids.tolist()  # [B]
        batch = len(roots)
        device = next_token_ids.device
        grown = [b for b in range(batch) if lookups is None or lookups.found[b] is None]
        growths = {b: TreeGrowth(roots[b], spec, None, None, device) for b in grown}
        if grown:
            root_logits = model.compute_logits(root_hidden[grown])  # [G, V]
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
            logits = tree_levels.tree_level(model, context, torch.cat(ids), torch.tensor(positions, device=device), levels)
            for b, rows, _ in levels:
                growths[b].advance(logits[rows])
        drafts = torch.empty(batch, count, dtype=torch.long)
        for b in range(batch):
            grew = growths[b].result() if b in growths else lookup_tree(roots[b], lookups.found[b], spec.budget)
            drafted = verification.preorder(verification.pad_tree(grew, spec.budget))
            drafts[b] = drafted.tokens[1: count + 1]
            if b < len(req_ids) and req_ids[b] is not None:
                self.drafted.by_request[req_ids[b]] = drafted
        self.drafted.forget_all_but(set(req_ids))
        return drafts.to(device)

    def plan(self, view: RunnerView, scheduler_output: Any, target_layer_names: frozenset[str],
             kv_layout: Any) -> None:
        """RunnerPrepareInputsPatch's hook (through MoAProposer.plan_tree_step): this step's trees."""
        reason = verification.chain_only_reason(view.sampling_metadata,
                                                scheduler_output.has_structured_output_requests, view.logprobs_mode)
        if reason is not None:
            if reason != self._chain_only_reason:
                self._logger.info("MoA draft trees: verified as chains while the batch uses %s", reason)
            self._chain_only_reason = reason
            self.step_in_flight = None
            return
        self.step_in_flight = verification.plan_step(
            self.drafted, scheduler_output.scheduled_spec_decode_tokens, view.req_id_to_index,
            view.query_start_loc(), view.num_computed_tokens(), view.positions, target_layer_names, kv_layout,
        )

    def accept(self, view: RunnerView, logits: Tensor, spec_decode_metadata: Any, sampler_output: Any,
               target_caches: list[Tensor], slot_mapping: Tensor) -> None:
        """RunnerSamplePatch's hook (through MoAProposer.accept_tree_step): accept along the trees."""
        step, self.step_in_flight = self.step_in_flight, None
        if step is None or spec_decode_metadata is None:
            return
        step.accept(
            logits, spec_decode_metadata.cu_num_sampled_tokens, view.sampling_metadata,
            sampler_output.sampled_token_ids, target_caches, slot_mapping, view.input_ids,
            view.positions, sampler_output.logprobs_tensors, view.logprobs_mode,
        )
