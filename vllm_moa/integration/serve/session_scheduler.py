"""vLLM's scheduler for the client-server backend's live sessions: a resumable request that can
be cut back to its session's verified tokens before its next chunk.

A live session (vllm_backend.py) keeps one resumable vLLM request (streaming input) between
verification rounds: each round appends its root and draft as the next chunk, so only those
are computed. vLLM appends a chunk to everything the request computed before (its last sampled
token aside), but a round's draft is only partly accepted; the next chunk must start where the
session's verified tokens end. It says so in its sampling parameters:

    SamplingParams.extra_args["moa_rollback_to"] = n   # keep the request's first n tokens

`SessionScheduler._update_request_as_session` (the scheduler's step that applies a chunk to its
waiting request) first cuts the request to n tokens: tokens, prompt and computed count, the KV
blocks past the n-th token returned to the pool (their prefix-cache entries stay: they hold the
K/V of the tokens they were hashed with). The block holding the cut is the one whose content
changes: if it was full and entered the prefix cache, its entry is dropped when this request is
its only holder; if another request shares it, this request lets it go and recomputes its
tokens from that block's start. A chunk that ends in a draft tree (session_trees.py) has the
blocks holding its nodes hashed with random bytes, so the prefix cache never serves them as a
chain of the same tokens. A later chunk never reads the prefix cache (vLLM looks it up only
for a request with nothing computed), so every position of a round is computed, and captured.

Chosen through vLLM's `scheduler_cls` engine argument (the backend sets it; async scheduling is
not used with it). It touches the scheduler's request and KV-block bookkeeping of vLLM 0.32
(`Request._all_token_ids`, the single-type manager's `req_to_blocks` and `num_cached_block`),
which tests/integration/vllm/test_vllm_live_sessions.py exercises on the real engine.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from vllm_moa.integration.serve.chunk_args import ROLLBACK_ARG, tree_spec

# cuts made in this process: "rollbacks", "evicted_cached_blocks" (the cut block's prefix-cache
# entry dropped), "recomputed_shared_blocks" (the cut block was shared: its tokens recomputed);
# "hidden_tree_blocks": blocks of tree chunks given hashes no lookup asks for
COUNTERS: Counter[str] = Counter()


class SessionScheduler(Scheduler):
    """vLLM's scheduler, with chunks of resumable requests that may cut the request back first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        groups = len(self.kv_cache_manager.coordinator.single_type_managers)
        if groups != 1:
            raise ValueError(f"the live sessions of vllm-moa's client-server backend need a target with one KV-cache "
                             f"group (full attention in every layer); this one has {groups}: serve it with "
                             f"live_sessions=0")

    def _update_request_as_session(self, session: Any, update: Any) -> None:
        params = update.sampling_params
        keep = (params.extra_args or {}).get(ROLLBACK_ARG) if params is not None else None
        if keep is not None:
            self._cut_back(session, update, int(keep))
        super()._update_request_as_session(session, update)
        tree = tree_spec(params)
        if tree is not None:
            self._hide_tree_blocks(session, int(tree["root"]) + 1)

    def _hide_tree_blocks(self, session: Any, first_node: int) -> None:
        """Give the blocks from the one holding position `first_node` on hashes no lookup asks for
        (random bytes): their rows are a tree's, computed at tree positions (session_trees.py), and a
        request with the same tokens as a chain must compute its own. A later block's hash chains
        from these, so it stays out of reach too; a chain's rows kept past them are lost to the
        prefix cache, never wrong in it."""
        start = first_node // self.hash_block_size
        hidden = len(session.block_hashes) - start
        if hidden > 0:
            session.block_hashes[start:] = [os.urandom(len(h)) for h in session.block_hashes[start:]]
            COUNTERS["hidden_tree_blocks"] += hidden

    def _cut_back(self, session: Any, update: Any, keep: int) -> None:
        """Cut the waiting request to its first `keep` tokens, with what the chunk appends after them."""
        keep = max(0, min(keep, session.num_tokens))
        manager = self.kv_cache_manager.coordinator.single_type_managers[0]
        block_size, request_id = manager.block_size, session.request_id
        blocks = manager.req_to_blocks[request_id]
        computed = min(keep, session.num_computed_tokens)  # KV valid up to here
        cut_block = computed // block_size
        if computed % block_size and cut_block < len(blocks) and blocks[cut_block].block_hash is not None:
            if blocks[cut_block].ref_cnt == 1:  # only this request holds it: its content may change
                self.kv_cache_manager.evict_blocks({blocks[cut_block].block_id})
                COUNTERS["evicted_cached_blocks"] += 1
            else:  # shared: leave it to its other holders and compute its tokens again
                computed = cut_block * block_size
                COUNTERS["recomputed_shared_blocks"] += 1
        kept_blocks = -(-computed // block_size)
        tail = blocks[kept_blocks:]
        del blocks[kept_blocks:]
        manager.block_pool.free_blocks(reversed(tail))  # tail first, as vLLM frees a request
        if request_id in manager.num_cached_block:
            manager.num_cached_block[request_id] = min(manager.num_cached_block[request_id], computed // block_size)
        again = session._all_token_ids[computed:keep]  # verified tokens whose KV must be computed again
        session.num_computed_tokens = computed
        del session._all_token_ids[computed:]
        del session.prompt_token_ids[computed:]
        session.num_prompt_tokens = computed
        update.prompt_token_ids = again + list(update.prompt_token_ids or ())
        COUNTERS["rollbacks"] += 1
