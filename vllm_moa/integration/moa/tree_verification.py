"""Draft trees verified inside vLLM's V1 engine, one step at a time.

vLLM verifies chains: a request's K draft tokens are scheduled after its last sampled token, at
positions p+1 .. p+K, each attending causally to all before it, and the rejection sampler walks
them in order. MoA drafts an EAGLE-2 tree of B nodes instead (MoAProposer) and hands the
scheduler its tokens parents-first (num_speculative_tokens = B: slots, lookahead and the
scheduler's accounting stay vLLM's); the parent array stays in the worker (`DraftedTrees`).
Three declared patches (shell/tree_patches.py) then make one target forward verify the tree;
the step being verified travels on the proposer's TreeDrafting (tree_drafts.py), not in a global:

    1. after vLLM's `_prepare_inputs` laid the step out as chains (slot mapping from the chain
       positions, so node j's KV is written at logical position p+1+j), `plan_step` turns the
       RoPE positions of each tree's rows into p + depth and records the step (`TreeStep`);
    2. in the target's attention layers, `TreeStep.attend` recomputes the output rows of the draft
       nodes with the tree mask (a node sees the prefix 0..p and its own ancestors):
       `vllm_moa.kernels.tree_attention_paged`, the Triton kernel on GPU; on CPU
       `tree_attention_planned`, with what the step's layers share (each tree's blocks and mask)
       read once per step (`plan_tree_attention`) instead of at every layer;
    3. after vLLM's sampler, `TreeStep.accept` replaces the output rows of tree requests by the
       accepted path and the next token (decoding/verify.py: greedy, or lossless recursive
       rejection with point-mass children), moves the accepted nodes' target KV to the slots a
       chain would have used (p+1 .. p+a), and rewrites the step's input ids and positions as that
       chain. From there on vLLM (bookkeeping, metrics, prefix caching, preemption) and the
       drafter's first pass see an ordinary chain of a accepted tokens; rejected nodes' KV lies
       beyond the sequence and is overwritten before anything reads it.

A tree whose shape is a chain (top_k = 1, or a prefix the scheduler cut to a chain) needs none of
this and is left to vLLM. Sampling parameters applied here: temperature, top-k, top-p and seeds
(vLLM's own `apply_top_k_top_p`), and logprobs in vLLM's raw modes (the accepted path's rows). A
step whose batch uses what vLLM applies to chain rows only (penalties, processed logprobs, token
masks, logits processors, grammars: `chain_only_reason`) verifies its drafts as chains of the
trees' tokens, which is always correct.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from vllm_moa.decoding.tree import DraftTree
from vllm_moa.decoding.verify import greedy_accept, sampled_accept
from vllm_moa.kernels import (
    TreeAttentionPlan,
    plan_tree_attention,
    split_kv_cache,
    tree_ancestor_masks,
    tree_attention_paged,
    tree_attention_planned,
    use_triton,
)
from vllm_moa.kernels.paged import gather_slots, write_slots

# attention backends whose forward the tree patches mask (shell/tree_patches.py): CPU_ATTN through
# the planned PyTorch path, TRITON_ATTN and FLASH_ATTN through the Triton tree kernel (kernels/tree.py)
# after the backend's own causal forward; both GPU backends lay the cache out as compat.packed_kv_layout
TREE_BACKENDS = ("CPU_ATTN", "TRITON_ATTN", "FLASH_ATTN")
GREEDY_BELOW = 1e-5  # vLLM treats temperatures below its _SAMPLING_EPS as greedy
PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID in sampled_token_ids


@dataclass
class DraftedTrees:
    """What MoAProposer drafted last, by request id: DraftTree over [root] + nodes (the root's
    token is a placeholder: the target samples it)."""

    by_request: dict[str, DraftTree] = field(default_factory=dict)

    def tree_for(self, req_id: str, scheduled: list[int]) -> DraftTree | None:
        """The drafted tree cut to the m draft tokens the scheduler gave this request (its first
        m nodes, closed under parents), or None when they are not a drafted tree's first m nodes
        or form a chain (then vLLM verifies them as a chain, which is always correct)."""
        tree = self.by_request.get(req_id)
        m = len(scheduled)
        if tree is None or m == 0 or tree.size < m + 1 or tree.tokens[1:m + 1].tolist() != list(scheduled):
            return None
        if tree.parents[: m + 1] == list(range(-1, m)):
            return None
        return DraftTree(tree.tokens[: m + 1], tree.parents[: m + 1], tree.depths[: m + 1], tree.feed_slots[: m + 1])

    def forget_all_but(self, req_ids: set[str]) -> None:
        """Drop the trees of requests no longer in the batch."""
        for req_id in [r for r in self.by_request if r not in req_ids]:
            del self.by_request[req_id]


def preorder(tree: DraftTree) -> DraftTree:
    """The same tree, nodes in depth-first order with each node's children best first (growth
    order: decoding/tree.py gives siblings in score order). Parents still come first, and the
    first nodes are the drafter's best path: where the scheduler cuts the drafts short, or a step
    verifies them as a chain (chain_only_reason), that path is what remains."""
    order = preorder_nodes(tree)
    index = {old: new for new, old in enumerate(order)}
    return DraftTree(tree.tokens[torch.tensor(order)], [index[tree.parents[i]] if i else -1 for i in order],
                     [tree.depths[i] for i in order], [tree.feed_slots[i] for i in order])


def preorder_nodes(tree: DraftTree) -> list[int]:
    """The tree's node indices depth first, each node's children in the tree's order."""
    children = tree.children()
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    return order


def pad_tree(tree: DraftTree, budget: int) -> DraftTree:
    """A tree of exactly `budget` nodes: the scheduler takes a fixed count per request. A growth
    that found fewer candidates (a warped distribution with less support) gets copies of the
    root's first child as further root children: verification tries siblings in order, so a
    copy is never accepted where the original was rejected (greedy), and recursive rejection
    gives it probability 0 once the original's token is removed from p."""
    missing = budget - (tree.size - 1)
    if missing <= 0:
        return tree
    tokens = tree.tokens.tolist()
    first = tokens[1] if len(tokens) > 1 else tokens[0]
    return DraftTree(torch.tensor(tokens + [first] * missing), tree.parents + [0] * missing,
                     tree.depths + [1] * missing, tree.feed_slots + [-1] * missing)


@dataclass
class TreeRequest:
    """One request's tree in this step. Rows are indices into the step's flattened tokens."""

    index: int  # row in the input batch
    first_row: int  # the row of its last sampled token (the tree's root)
    prefix: int  # p: its computed tokens (the root sits at position p)
    tree: DraftTree  # root + m nodes; node i is row first_row + i


@dataclass
class TreeStep:
    """The trees of one engine step (built by plan_step, used by attend and accept)."""

    requests: list[TreeRequest]
    layer_names: frozenset[str]  # the target's attention layers (the drafter's are not masked)
    layout: Any  # the target KV cache's layout reader (compat.KVLayout)
    chain_positions: Tensor  # [T] the chain positions vLLM gave the node rows (restored in accept)
    node_rows: Tensor  # [T] rows of every tree's nodes, request by request
    req_rows: Tensor  # [R] input-batch rows of the tree requests
    prefix_lens: Tensor  # [R] p + 1: the root is part of every node's prefix
    cu_nodes: Tensor  # [R + 1] node offsets
    ancestor_masks: Tensor  # [T] int64 (kernels.tree_ancestor_masks)
    max_nodes: int = 0  # the largest tree's node count (host: the Triton kernel needs no device sync)
    max_prefix: int = 0  # the longest prefix (p + 1), likewise
    # CPU: what every target layer of the step shares, planned at the first layer (by block table
    # and block size: the target's layers share one KV-cache group)
    _plan: tuple[tuple[int, int, int], TreeAttentionPlan] | None = field(default=None, init=False, repr=False)
    # GPU: the step's index tensors on the layers' device, copied once per step
    _on_device: tuple[torch.device, tuple[Tensor, ...]] | None = field(default=None, init=False, repr=False)

    # -- 2. the target's attention ---------------------------------------------------------------
    def attend(self, layer: Any, scale: float, query: Tensor, kv_cache: Tensor, block_table: Tensor,
               output: Tensor) -> None:
        """Recompute the node rows of `output` [N, H * d] (or [N, H, d]) with the tree mask.
        query [N, H, d]; block_table [num_reqs, max_blocks]: the layer's kernel block table."""
        if layer.layer_name not in self.layer_names:
            return
        heads, head_dim = query.shape[1], query.shape[2]
        if use_triton(query.device):
            rows, req_rows, prefix_lens, cu_nodes, masks = self.device_tensors(query.device)
            out = tree_attention_paged(
                query[rows], kv_cache, block_table[req_rows.to(block_table.device)], prefix_lens, cu_nodes, masks,
                layout=self.layout, sm_scale=scale, max_tree_nodes=self.max_nodes, max_prefix_len=self.max_prefix,
            )  # [T, H, d]
        else:
            rows = self.node_rows.to(query.device)
            out = tree_attention_planned(query[rows], kv_cache, self._plan_for(kv_cache, block_table, heads),
                                         layout=self.layout, sm_scale=scale)  # [T, H, d]
        output.view(output.shape[0], heads, head_dim)[rows] = out.to(output.dtype)

    def device_tensors(self, device: torch.device) -> tuple[Tensor, ...]:
        """(node_rows, req_rows, prefix_lens, cu_nodes, ancestor_masks) on `device`, copied at the
        step's first target layer and reused by the others."""
        if self._on_device is None or self._on_device[0] != device:
            tensors = (self.node_rows, self.req_rows, self.prefix_lens, self.cu_nodes, self.ancestor_masks)
            self._on_device = device, tuple(t.to(device, non_blocking=True) for t in tensors)
        return self._on_device[1]

    def _plan_for(self, kv_cache: Tensor, block_table: Tensor, heads: int) -> TreeAttentionPlan:
        k = split_kv_cache(kv_cache, self.layout)[0]  # [num_blocks, block_size, H_kv, d]
        block_size, groups = k.shape[1], heads // k.shape[2]
        key = (block_table.data_ptr(), block_size, groups)
        if self._plan is None or self._plan[0] != key:
            tables = block_table[self.req_rows.to(block_table.device)]
            self._plan = key, plan_tree_attention(tables, self.prefix_lens, self.cu_nodes, self.ancestor_masks,
                                                  block_size, groups)
        return self._plan[1]

    # -- 3. acceptance ---------------------------------------------------------------------------
    def accept(self, logits: Tensor, cu_num_sampled: Tensor, sampling: Any, sampled: Tensor,
               target_caches: list[Tensor], slot_mapping: Tensor, input_ids: Tensor, positions: Tensor,
               logprobs: Any = None, logprobs_mode: str = "raw_logprobs") -> None:
        """Replace tree requests' rows of vLLM's `sampled` [num_reqs, max_spec + 1] by their
        accepted path + next token (and their rows of vLLM's `logprobs`, a LogprobsTensors over
        the same num_reqs * (max_spec + 1) rows, when the batch asked for them); move the path's
        KV to the chain's slots in every target layer cache; rewrite the step's `input_ids` /
        `positions` [N] as that chain.

        logits [num_logits, V]: request r's m + 1 rows (root, then its nodes) start at
        cu_num_sampled[r - 1]; slot_mapping [N]: where the step's rows wrote their KV."""
        first_logit = torch.cat([cu_num_sampled.new_zeros(1), cu_num_sampled]).tolist()
        src, dst = [], []
        for req in self.requests:
            n = req.tree.size
            lo = first_logit[req.index]
            rows = logits[lo: lo + n].float()  # [m + 1, V]
            path, next_token = self._walk(req, rows, sampling)
            tokens = [int(req.tree.tokens[node]) for node in path[1:]] + [next_token]
            sampled[req.index].fill_(PLACEHOLDER)
            sampled[req.index, : len(tokens)] = torch.tensor(tokens, dtype=sampled.dtype, device=sampled.device)
            if logprobs is not None:
                _path_logprobs(logprobs, req.index * sampled.shape[1], rows[path], tokens, logprobs_mode)
            for depth, node in enumerate(path[1:], start=1):
                input_ids[req.first_row + depth] = int(req.tree.tokens[node])
                if node != depth:
                    src.append(req.first_row + node)
                    dst.append(req.first_row + depth)
        positions[self.node_rows.to(positions.device)] = self.chain_positions.to(positions.device)
        if src:
            rows_src = slot_mapping[torch.tensor(src, device=slot_mapping.device)]
            rows_dst = slot_mapping[torch.tensor(dst, device=slot_mapping.device)]
            for cache in target_caches:  # gathered before written: a source is never overwritten first
                k, v = gather_slots(cache, rows_src, self.layout)
                write_slots(cache, rows_dst, k, v, self.layout)

    @staticmethod
    def _walk(req: TreeRequest, rows: Tensor, sampling: Any) -> tuple[list[int], int]:
        temperature = None if sampling.all_greedy else float(sampling.temperature[req.index])
        if temperature is None or temperature < GREEDY_BELOW:
            return greedy_accept(req.tree, rows)
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        n = rows.shape[0]
        top_k = None if sampling.top_k is None else sampling.top_k[req.index].expand(n)
        top_p = None if sampling.top_p is None else sampling.top_p[req.index].expand(n)
        probs = torch.softmax(apply_top_k_top_p(rows / temperature, top_k, top_p), dim=-1)
        return sampled_accept(req.tree, probs, sampling.generators.get(req.index))


def _path_logprobs(logprobs: Any, first_row: int, rows: Tensor, tokens: list[int], mode: str) -> None:
    """Rows first_row .. first_row + len(tokens) - 1 of vLLM's LogprobsTensors, for the accepted
    tokens: token j's top logprobs and rank under the target's raw distribution after the path's
    first j nodes (rows [len(tokens), V]), as vLLM's Sampler.gather_logprobs gives them for chains
    ("raw_logprobs": log-softmax of the raw logits; "raw_logits": the logits)."""
    from vllm.v1.sample.sampler import Sampler

    values = Sampler.compute_logprobs(rows) if mode == "raw_logprobs" else rows
    width = logprobs.logprob_token_ids.shape[1] - 1
    ids = torch.tensor(tokens, dtype=torch.int64, device=rows.device)
    gathered = Sampler.gather_logprobs(values, width, ids)
    span = slice(first_row, first_row + len(tokens))
    logprobs.logprob_token_ids[span] = gathered.logprob_token_ids.to(logprobs.logprob_token_ids.dtype)
    logprobs.logprobs[span] = gathered.logprobs.to(logprobs.logprobs.dtype)
    logprobs.selected_token_ranks[span] = gathered.selected_token_ranks.to(logprobs.selected_token_ranks.dtype)


# -- 1. the step's plan ------------------------------------------------------------------------------
# logprobs modes whose values tree acceptance computes itself (_path_logprobs); the processed
# modes (after penalties, temperature, top-k/top-p) stay with vLLM's chain machinery
TREE_LOGPROBS_MODES = ("raw_logprobs", "raw_logits")
# vLLM's built-in logits processors and the state that says a request of the batch uses them
_PROCESSOR_STATE = {"MinPLogitsProcessor": "min_p_count", "LogitBiasLogitsProcessor": "biases",
                    "MinTokensLogitsProcessor": "min_toks"}


def chain_only_reason(sampling: Any, structured_output: bool, logprobs_mode: str = "raw_logprobs") -> str | None:
    """Why this step's drafts must be verified by vLLM's own chain machinery (as a chain of the
    tree's tokens in parents-first order, which is always correct), or None: what vLLM applies to
    chain rows that tree acceptance does not (penalties, processed logprobs, token masks, logits
    processors, grammars). `sampling`: the batch's SamplingMetadata; `logprobs_mode`: the
    engine's (ModelConfig.logprobs_mode)."""
    if structured_output:
        return "structured output"
    if sampling.max_num_logprobs is not None and logprobs_mode not in TREE_LOGPROBS_MODES:
        return f"logprobs in mode {logprobs_mode}"
    if not sampling.no_penalties:
        return "penalties"
    if sampling.allowed_token_ids_mask is not None or sampling.bad_words_token_ids:
        return "allowed or bad token ids"
    thinking = getattr(sampling, "thinking_budget_state_holder", None)
    if thinking is not None and thinking.has_tracked_requests():
        return "a thinking-token budget"
    for processor in sampling.logitsprocs.all:
        state = _PROCESSOR_STATE.get(type(processor).__name__)
        if state is None or getattr(processor, state):
            return f"logits processor {type(processor).__name__}"
    return None


def plan_step(drafted: DraftedTrees, spec_tokens: dict[str, list[int]], req_id_to_index: dict[str, int],
              query_start_loc: np.ndarray, num_computed: np.ndarray, positions: Tensor,
              layer_names: frozenset[str], layout: Any) -> TreeStep | None:
    """The step's trees (None when no request verifies a tree); sets their node rows' RoPE
    positions [N] to prefix + depth. spec_tokens: the scheduler's draft tokens by request;
    query_start_loc [num_reqs + 1] and num_computed [num_reqs]: the step's layout on the host."""
    requests: list[TreeRequest] = []
    for req_id, scheduled in spec_tokens.items():
        tree = drafted.tree_for(req_id, scheduled)
        index = req_id_to_index.get(req_id)
        if tree is None or index is None:
            continue
        first, last = int(query_start_loc[index]), int(query_start_loc[index + 1])
        if last - first != len(scheduled) + 1:  # not a decode step of root + drafts
            continue
        requests.append(TreeRequest(index, first, int(num_computed[index]), tree))
    return tree_step(requests, positions, layer_names, layout)


def tree_step(requests: list[TreeRequest], positions: Tensor, layer_names: frozenset[str],
              layout: Any) -> TreeStep | None:
    """The step verifying `requests`' trees (None when there are none); sets their node rows' RoPE
    positions in `positions` [N] to prefix + depth (the chain positions kept in the step)."""
    if not requests:
        return None
    requests = sorted(requests, key=lambda r: r.index)
    node_rows = torch.cat([torch.arange(r.first_row + 1, r.first_row + r.tree.size) for r in requests])
    depth_positions = torch.cat([r.prefix + torch.tensor(r.tree.depths[1:]) for r in requests])
    device = positions.device
    chain_positions = positions[node_rows.to(device)].clone()
    positions[node_rows.to(device)] = depth_positions.to(device=device, dtype=positions.dtype)
    sizes = torch.tensor([r.tree.size - 1 for r in requests])
    cu_nodes = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
    # kernel convention: parents within the nodes, -1 for children of the root
    kernel_parents = torch.cat([torch.tensor(r.tree.parents[1:]) - 1 for r in requests])
    return TreeStep(
        requests=requests, layer_names=layer_names, layout=layout, chain_positions=chain_positions,
        node_rows=node_rows, req_rows=torch.tensor([r.index for r in requests]),
        prefix_lens=torch.tensor([r.prefix + 1 for r in requests]), cu_nodes=cu_nodes,
        ancestor_masks=tree_ancestor_masks(kernel_parents, cu_nodes),
        max_nodes=max(r.tree.size - 1 for r in requests), max_prefix=max(r.prefix + 1 for r in requests),
    )
