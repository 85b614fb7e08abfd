"""A live session's draft tree verified in one chunk of its resumable vLLM request (the
client-server backend, vllm_backend.py): one target forward over the round's tokens, the tree's
nodes under the tree mask, instead of one request per root-to-leaf path.

A tree round's chunk is the session's tokens still to compute, then the root at position r and
the tree's nodes parents first (preorder: the drafter's best path first), so node i's K/V is
written at position r + i. Its verify spec says so (chunk_args.py):

    "tree": {"root": r, "parents": [-1, 0, 1, 0, ...]}   # node i's parent; the root's is -1

Three places of vLLM's engine then act on it:
  1. the scheduler (session_scheduler.py) gives every KV block holding node rows, and the blocks
     after them, prefix-cache hashes nobody asks for: those rows hold K/V computed at tree
     positions and are never served to another request as a chain of the same tokens;
  2. the runner's `_prepare_inputs` (RunnerPrepareInputsPatch, which finds `SessionTrees` on the
     runner as compat.STEP_PLANNER_ATTR) sets the nodes' RoPE positions to r + depth and plans the
     step's TreeStep (moa/tree_verification.py), which the attention patches apply in the target's
     layers (compat.TREE_VERIFIER_ATTR), as for the proposer's own trees;
  3. verify_service.collect reads the nodes' hidden states, logits and K/V as for a chain, then
     `finish` puts the chain positions back.

A chunk the scheduler split across steps (its token budget ran short) has node rows computed
without the mask: its capture says `tree_split` and the backend verifies that round as new
requests. After acceptance, the path's rows that sit where a chain would (node i at depth i) stay;
the request is cut back to them before its next chunk, which computes the rest again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vllm_moa.decoding.tree import DraftTree, depths_from_parents
from vllm_moa.integration.moa.tree_verification import TREE_BACKENDS, TreeRequest, TreeStep, tree_step
from vllm_moa.integration.serve.chunk_args import tree_spec, verify_spec
from vllm_moa.integration.shell import compat
from vllm_moa.integration.shell.draft_config import UnsupportedMoASetup, check_tree_graphs
from vllm_moa.integration.shell.runner_view import RunnerView
from vllm_moa.integration.shell.tree_patches import ATTENTION_PATCHES, RunnerPrepareInputsPatch

MAX_SPLIT_KEYS = 4096


def tree_chunks_unavailable(backend: str, cudagraph_mode: Any) -> str | None:
    """Why this engine cannot verify a tree in one chunk (then trees run as requests), or None."""
    if backend not in TREE_BACKENDS:
        return f"the attention backend {backend} has no tree mask (supported: {', '.join(TREE_BACKENDS)})"
    try:
        check_tree_graphs(cudagraph_mode)
    except UnsupportedMoASetup as err:
        return str(err)
    return None


def tree_in_step(root: int, nodes: int, computed: int, scheduled: int) -> str:
    """Where a tree of `nodes` nodes whose root sits at position `root` falls in a step that
    computes positions [computed, computed + scheduled): "whole", "later" (none of it yet) or
    "split" (some of its rows in another step: those lack the tree mask)."""
    if root >= computed + scheduled:
        return "later"
    if root < computed or root + nodes > computed + scheduled:
        return "split"
    return "whole"


class SessionTrees:
    """The worker's planner of tree chunks: set on the runner and on the target's attention layers."""

    def __init__(self, layer_names: list[str], layout: Any) -> None:
        self.layer_names = frozenset(layer_names)
        self.layout = layout
        self.step_in_flight: TreeStep | None = None  # read by the attention patches
        self.split: set[str] = set()  # capture keys of tree chunks split across steps (read by collect)

    def attach(self, runner: Any, target_layers: list[Any], backend: str) -> None:
        """Install the runner and attention hooks, and let them find this object."""
        RunnerPrepareInputsPatch.apply()
        ATTENTION_PATCHES[backend].apply()
        setattr(runner, compat.STEP_PLANNER_ATTR, self)
        for layer in target_layers:
            setattr(layer, compat.TREE_VERIFIER_ATTR, self)

    def plan_tree_step(self, runner: Any, scheduler_output: Any) -> None:
        """RunnerPrepareInputsPatch's hook: this step's tree chunks, each whole in the step."""
        self.step_in_flight = None
        view = RunnerView(runner)
        requests: list[TreeRequest] = []
        query_start, computed = view.query_start_loc(), view.num_computed_tokens()
        for req_id, count in scheduler_output.num_scheduled_tokens.items():
            request = runner.requests.get(req_id)
            params = getattr(request, "sampling_params", None)
            tree = tree_spec(params)
            index = view.req_id_to_index.get(req_id)
            if tree is None or index is None:
                continue
            root, parents = int(tree["root"]), [int(p) for p in tree["parents"]]
            done = int(computed[index])
            where = tree_in_step(root, len(parents), done, count)
            if where == "split":
                self._split(str(verify_spec(params)["key"]))
            if where != "whole":
                continue
            depths = depths_from_parents(parents)
            placeholder = torch.zeros(len(parents), dtype=torch.long)  # attention needs the shape, not the tokens
            requests.append(TreeRequest(index, int(query_start[index]) + root - done, root,
                                        DraftTree(placeholder, parents, depths, [-1] * len(parents))))
        self.step_in_flight = tree_step(requests, view.positions, self.layer_names, self.layout)

    def finish(self, positions: Tensor) -> None:
        """After the forward (the capture's read): the step's chain positions back."""
        step, self.step_in_flight = self.step_in_flight, None
        if step is not None:
            positions[step.node_rows.to(positions.device)] = step.chain_positions.to(positions.device)

    def was_split(self, key: str) -> bool:
        """Whether the tree chunk of capture `key` was split across steps (asked once)."""
        if key in self.split:
            self.split.discard(key)
            return True
        return False

    def _split(self, key: str) -> None:
        self.split.add(key)
        while len(self.split) > MAX_SPLIT_KEYS:
            self.split.pop()
