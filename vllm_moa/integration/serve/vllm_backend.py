"""`vllm-moa serve --backend vllm`: the client-server target on vLLM's engine.

A live session (the default, `live_sessions`) keeps one resumable vLLM request between rounds
(streaming input): a round appends its root and draft as the request's next chunk, after vLLM's
scheduler cut the request back to the session's verified tokens (session_scheduler.py), so a
round computes its own tokens and nothing else. A tree's nodes go in preorder (the drafter's best
path first) and are computed under the tree mask in the same forward (session_trees.py); the
accepted path's rows that sit where a chain's would stay valid. Live requests hold engine seats
and KV blocks, so they are bounded (live_sessions.py): a round that finds no free seat, a round
vLLM served partly from the prefix cache or a tree it split across steps, and trees on an engine
that cannot mask them (`EngineDriver.tree_chunks_unavailable`) run as new requests.

As a new request, a round's prompt is the session's verified tokens + the round's root + the
client's draft, generating one token (ignored). Prefix caching serves the verified prefix, so a
round computes its draft and the partial block before it; rounds of all sessions (and plain
generations) are batched by vLLM's scheduler step by step. A tree is then verified as its
root-to-leaf paths, one request each, in the same steps. Such a round verifies only the nodes
that end in the KV block of its root (`_within_block`: a prompt that filled that block could find
it in the prefix cache, leaving its positions uncomputed; the nodes cut count as rejected,
`counters["nodes_cut_at_block_end"]`); the same holds for a live request's first chunk. A round
whose draft positions were still served from the prefix cache is run again without reading the
cache (`counters["recomputes"]`). An open whose sync rows start in the prompt's full blocks reads
the prefix cache when the client's drafter needs only the target's K/V there (MoA without
final_hidden_rows): the worker reads the served positions' K/V from the paged caches, so a prompt
other sessions computed (a shared system prompt, the same prompt opened again) runs only its last block
(`counters["open_rows_from_cache"]`); for a drafter that reads hidden states (EAGLE-style) it
does not read the cache at all (the prompt would otherwise run twice).

Either way the worker hook (verify_service.py) returns the target's argmax (and logits, when
sampling) at the draft's positions and the per-layer K/V and final hidden states there;
acceptance and the drafter's sync payload are the transformers backend's own (`SessionBackend`),
so both servers answer a client alike. The engine is owned by one thread (engine_driver.py); if
it dies, every call in flight and after gets a 503 and `/v1/health` says so. Tensor parallelism is
refused (each rank would hold a share of the KV heads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vllm_moa import envs
from vllm_moa.decoding.tree import DraftTree
from vllm_moa.integration.moa.tree_verification import preorder_nodes
from vllm_moa.integration.serve.chunk_args import ROLLBACK_ARG, TREE_KEY, VERIFY_ARG
from vllm_moa.integration.serve.engine_driver import EngineDriver, EngineStopped, _Waiter
from vllm_moa.integration.serve.live_sessions import LiveSessions
from vllm_moa.integration.serve.verify_service import unpack
from vllm_moa.integration.shell import compat
from vllm_moa.integration.shell.queue_spin import engine_spin
from vllm_moa.integration.shell.signature import signature_from_hf_config
from vllm_moa.models import Drafter
from vllm_moa.serving.backend import BackendError, BackendSession, SessionBackend, _sampling
from vllm_moa.serving.protocol import GenerateRequest, OpenRequest, SyncPayload
from vllm_moa.target import TargetOutput

WORKER_EXTENSION = "vllm_moa.integration.serve.verify_service.VerifyWorkerExtension"
SESSION_SCHEDULER = "vllm_moa.integration.serve.session_scheduler.SessionScheduler"
# how long the engine's queue readers poll after a step before they sleep (VLLM_MOA_ENGINE_SPIN_MS
# overrides): between rounds the engine waits on the network, and vLLM's 1 s of polling per
# reader would take the cores the next round needs
ENGINE_SPIN_MS = 2.0


class VLLMBackend(SessionBackend):
    name = "vllm"

    def __init__(self, target_dir: str | Path, drafters: dict[str, Drafter] | None = None,
                 target_name: str | None = None, live_sessions: int | None = None, **engine: Any) -> None:
        """`live_sessions`: how many sessions keep a resumable vLLM request between rounds (their
        chains then compute only the round's tokens); None: half of the engine's max_num_seqs;
        0: none (every round is a new request)."""
        from transformers import AutoConfig
        from vllm.engine.arg_utils import EngineArgs

        version = compat.installed_vllm_version()
        if not compat.in_series(version, compat.VERIFY_SERIES):
            raise BackendError(f"the vLLM client-server backend runs inside vLLM {compat.VERIFY_VERSIONS} (its "
                               f"verification hook and live sessions' scheduler); this is vLLM {version}: serve "
                               "with --backend transformers, or install vLLM 0.32")
        if int(engine.get("tensor_parallel_size", 1)) != 1 or int(engine.get("pipeline_parallel_size", 1)) != 1:
            raise BackendError("the vLLM client-server backend runs the target on one device (tensor and pipeline "
                               "parallel size 1): each rank would hold a share of the KV heads the sync reads")
        hf_config = AutoConfig.from_pretrained(target_dir)
        signature = signature_from_hf_config(hf_config, target_dir)
        if target_name:
            signature = dataclasses.replace(signature, name=target_name)
        # the drafters are checked against the target before any engine process starts
        super().__init__(signature, hf_config.vocab_size, None, drafters)
        engine = {"dtype": "float32", "enable_prefix_caching": True, **engine}
        if live_sessions is not None and live_sessions < 0:
            raise BackendError(f"live_sessions must be >= 0, got {live_sessions}")
        if live_sessions != 0:  # the scheduler that cuts a live request back (session_scheduler.py)
            if engine.get("scheduler_cls") not in (None, SESSION_SCHEDULER) or engine.get("async_scheduling"):
                raise BackendError("live sessions run on vllm-moa's scheduler (scheduler_cls, without async "
                                   "scheduling); serve with live_sessions=0 to choose another")
            engine |= {"scheduler_cls": SESSION_SCHEDULER, "async_scheduling": False}
        args = EngineArgs(model=str(target_dir), skip_tokenizer_init=True, worker_extension_cls=WORKER_EXTENSION,
                          **engine)
        try:  # a bad VLLM_MOA_ENGINE_SPIN_MS is refused before any engine process starts
            envs.VLLM_MOA_ENGINE_SPIN_MS  # noqa: B018 (reading it checks it)
        except ValueError as error:
            raise BackendError(str(error)) from None
        with engine_spin(ENGINE_SPIN_MS):  # its queue readers sleep 2 ms after a step, not 1 s (queue_spin.py)
            self.driver = EngineDriver(args)
        config = self.driver.engine.vllm_config
        # a round's prompt plus the one token vLLM generates must fit in max_model_len
        self._context = config.model_config.max_model_len - 1
        self._block_size = config.cache_config.block_size
        self.round_block_size = self._block_size  # announced in /v1/info: the client drafts to it
        self.live: LiveSessions | None = None
        if live_sessions != 0:  # each holds a seat and its KV blocks: at most half of the KV cache
            seats = config.scheduler_config.max_num_seqs
            count = max(1, seats // 2) if live_sessions is None else min(live_sessions, seats - 1)
            kv_tokens = (config.cache_config.num_gpu_blocks or 0) * self._block_size
            self.live = LiveSessions(self.driver.end, count, kv_tokens // 2 or count * self._context)

    @classmethod
    def from_pretrained(cls, target_dir: str | Path, drafter_dirs: dict[str, str | Path] | None = None,
                        target_name: str | None = None, live_sessions: int | None = None,
                        **engine: Any) -> VLLMBackend:
        from vllm_moa.models import load_drafter

        drafters = {name: load_drafter(path).eval() for name, path in (drafter_dirs or {}).items()}
        return cls(target_dir, drafters, target_name, live_sessions, **engine)

    def healthy(self) -> str | None:
        problem = self.driver.problem()
        return None if problem is None else f"the vLLM engine stopped: {problem}"

    def shutdown(self) -> None:
        self.driver.stop()

    # -- rounds ---------------------------------------------------------------------------------
    def _open_round(self, session: BackendSession, request: OpenRequest) -> tuple[int, SyncPayload]:
        prompt, n = list(request.prompt), len(request.prompt)
        sync_rows = session.kind.server_sync is not None
        rows_from = request.sync_from if sync_rows else n
        logits_from = n if request.pending is not None else n - 1
        # rows wanted in a full block, which the prefix cache could serve uncomputed: read from it
        # (their K/V) for a drafter that reads no hidden state there, else not read at all
        cached_rows = sync_rows and rows_from < n and not session.kind.sync_reads_hidden(session.drafter)
        read_cache = cached_rows or rows_from >= (n - 1) // self._block_size * self._block_size
        view = self._round([prompt], rows_from, logits_from, session.sampling is not None and request.pending is None,
                           lambda p, pos: pos, read_cache, cached_rows)
        if cached_rows and view.without_hidden:
            self._count("open_rows_from_cache", len(view.without_hidden))
        if request.pending is not None:
            first = request.pending
        elif session.sampling is None:
            first = view.argmax(n - 1)
        else:
            first = self._pick(session, view.logits([n - 1]))
        if not sync_rows or rows_from == n:
            return first, SyncPayload(start=request.sync_from, count=n - request.sync_from)
        nodes = list(range(rows_from, n))
        return first, self._sync(session, view.target_output(nodes), list(range(len(nodes))), request.sync_from)

    def _verify_round(self, session: BackendSession, seq: int, tree: DraftTree) -> tuple[list[int], int, SyncPayload]:
        if self.live is not None and (tree.is_chain or self.driver.tree_chunks_unavailable is None):
            done = self._live_round(session, seq, tree)
            if done is not None:
                return done
        return self._request_round(session, seq, tree)

    def _live_round(self, session: BackendSession, seq: int,
                    tree: DraftTree) -> tuple[list[int], int, SyncPayload] | None:
        """The draft verified as the next chunk of the session's resumable request, cut back to the
        verified tokens first (session_scheduler.py); a tree's nodes in preorder, under the tree mask
        (session_trees.py). None when every live seat is busy, vLLM served a position from the
        prefix cache or split a tree across steps (the round then runs as new requests)."""
        live = self.live.claim(session, seq + tree.size)
        if live is None:
            self._count("live_rounds_without_a_seat")
            return None
        order = preorder_nodes(tree)  # chunk node i: the client's node order[i], at position seq + i
        try:
            if not live.started:  # a first chunk reads the prefix cache: its draft ends in the root's block
                limit = self._block_size - seq % self._block_size
                if limit < tree.size:  # preorder's first nodes are closed under ancestors
                    self._count("nodes_cut_at_block_end", tree.size - limit)
                    order = order[:limit]
            work = _subtree(tree, order)
            chain = work.is_chain
            base = min(live.valid, seq)  # the request's tokens that stay; session.tokens[base:seq] come again
            waiter = _Waiter(verify=True, external=live.external, first=not live.started)
            spec = {"key": waiter.key, "rows_from": seq, "logits_from": seq, "logits": session.sampling is not None}
            if not chain:
                spec[TREE_KEY] = {"root": seq, "parents": work.parents}
            extra = {VERIFY_ARG: spec, **({ROLLBACK_ARG: base} if live.started else {})}
            self.driver.submit(waiter, session.tokens[base:seq] + work.tokens.tolist(), self._params(extra, False))
            capture = waiter.get(self.driver)[1]
        except BaseException:
            self.live.end(live)  # its request is in an unknown state: a new one next round
            raise
        view = _RoundView(session.sampling is not None)
        view.add(0, capture, lambda p, pos: pos - seq)
        nodes = list(range(work.size))
        if capture.get("tree_split") or not all(node in view.rows and node in view.heads for node in nodes):
            self.live.release(live, seq)
            self._count("live_trees_split" if capture.get("tree_split") else "live_rounds_served_from_cache")
            return None
        logits = view.logits(nodes) if session.sampling is not None else None  # [N, V]
        path, nxt = self._accept(session, work, logits, [view.argmax(i) for i in nodes])
        if waiter.request_ended:  # vLLM ended the request with this chunk
            self.live.forget(live)
        else:  # the path's rows where a chain's would be (node i at depth i) stay valid
            in_place = next((i for i, node in enumerate(path) if node != i), len(path))
            self.live.release(live, seq + in_place)
        self._count("live_rounds" if chain else "live_tree_rounds")
        sync = self._sync(session, view.target_output(path), list(range(len(path))), seq)
        return [order[node] for node in path], nxt, sync

    def _request_round(self, session: BackendSession, seq: int,
                       tree: DraftTree) -> tuple[list[int], int, SyncPayload]:
        """The tree verified as new requests, one per root-to-leaf path."""
        keep = _within_block(tree, seq, self._block_size)
        if len(keep) < tree.size:  # verify the nodes that end in the root's KV block; the rest count as rejected
            self._count("nodes_cut_at_block_end", tree.size - len(keep))
            path, nxt, sync = self._request_round(session, seq, _subtree(tree, keep))
            return [keep[i] for i in path], nxt, sync
        tokens = tree.tokens.tolist()
        paths = _root_to_leaf_paths(tree)
        prompts = [session.tokens[:seq] + [tokens[i] for i in path] for path in paths]
        view = self._round(prompts, seq, seq, session.sampling is not None, lambda p, pos: paths[p][pos - seq])
        nodes = list(range(tree.size))
        logits = view.logits(nodes) if session.sampling is not None else None  # [N, V]
        path, nxt = self._accept(session, tree, logits, [view.argmax(i) for i in nodes])
        return path, nxt, self._sync(session, view.target_output(path), list(range(len(path))), seq)

    def _round(self, prompts: list[list[int]], rows_from: int, logits_from: int, want_logits: bool,
               node_of: Callable[[int, int], int], read_cache: bool = True, cached_rows: bool = False) -> _RoundView:
        """One vLLM request per prompt, all in flight together; prompt p's position pos is node
        node_of(p, pos) (a tree's paths share nodes). Nodes that no capture holds (their
        positions were served from the prefix cache, and not read from it: `cached_rows`) are
        asked again without the cache."""
        def submit(prompt: list[int], skip_cache: bool) -> _Waiter:
            waiter = _Waiter(verify=True)
            spec = {"key": waiter.key, "rows_from": rows_from, "logits_from": logits_from, "logits": want_logits,
                    "cached_rows": cached_rows}
            return self.driver.submit(waiter, prompt, self._params({VERIFY_ARG: spec}, skip_cache))

        view = _RoundView(want_logits)
        waiters = [submit(prompt, not read_cache) for prompt in prompts]
        answered = 0
        try:
            for p, waiter in enumerate(waiters):
                view.add(p, waiter.get(self.driver)[1], node_of)
                answered += 1
        except BaseException:
            for waiter in waiters[answered:]:  # this path (if still running) and the others: unread
                self.driver.abort(waiter)
            raise
        wanted = {node_of(p, pos) for p, prompt in enumerate(prompts) for pos in range(rows_from, len(prompt))}
        heads = {node_of(p, pos) for p, prompt in enumerate(prompts) for pos in range(logits_from, len(prompt))}
        again = sorted({p for p, prompt in enumerate(prompts)
                        for pos in range(min(rows_from, logits_from), len(prompt))
                        if (node_of(p, pos) in wanted and node_of(p, pos) not in view.rows)
                        or (node_of(p, pos) in heads and node_of(p, pos) not in view.heads)})
        if again:
            self._count("recomputes", len(again))
            for p, waiter in [(p, submit(prompts[p], True)) for p in again]:
                view.add(p, waiter.get(self.driver)[1], node_of)
            if not (wanted <= set(view.rows) and heads <= set(view.heads)):
                raise EngineStopped("vLLM did not compute the draft's positions even without the prefix cache")
        return view

    @staticmethod
    def _params(extra_args: dict, skip_cache: bool) -> Any:
        """A verification request's (or chunk's) sampling parameters: one token, ignored."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VllmSamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                  output_kind=RequestOutputKind.FINAL_ONLY, extra_args=extra_args,
                                  skip_reading_prefix_cache=skip_cache or None)

    # -- plain generation -----------------------------------------------------------------------
    def generate(self, request: GenerateRequest) -> Iterator[int]:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._check_generate(request)
        sampling = _sampling(request.sampling)
        options = request.sampling
        params = VllmSamplingParams(
            max_tokens=request.max_tokens, ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.DELTA,
            stop_token_ids=[request.eos_token_id] if request.eos_token_id is not None else None,
            temperature=0.0 if sampling is None else options.temperature,
            top_k=options.top_k if sampling is not None and options.top_k else 0,
            top_p=options.top_p if sampling is not None else 1.0, seed=options.seed)
        return self._stream(list(request.prompt), params)

    def _stream(self, prompt: list[int], params: Any) -> Iterator[int]:
        """Submitted at the first next(): a generator closed before that never reaches vLLM."""
        waiter = self.driver.submit(_Waiter(verify=False), prompt, params)
        self._count("generates")
        finished = False
        try:
            while not finished:
                _, tokens, finished = waiter.get(self.driver)
                yield from tokens
        finally:
            if not finished:  # the client went away, or the engine failed: free its slot in vLLM
                self.driver.abort(waiter)

    def close(self, session: BackendSession) -> None:
        super().close(session)  # after a round in flight
        if self.live is not None:
            self.live.end(session.live)  # its live request, if any: vLLM then holds only prefix-cached blocks


def _within_block(tree: DraftTree, seq: int, block_size: int) -> list[int]:
    """The nodes whose positions end in the KV block of the root's position `seq` (all ancestors
    kept). A round's prompt that fills that block could find it in the prefix cache (another
    request computed the same tokens: a repeated prompt, an earlier client of the same text), and
    positions served from the cache are not computed, so nothing of them is captured and the round
    would be run again over its whole prompt; vLLM never serves a prompt's last token from the
    cache, so a prompt ending in the root's block computes every position from the root on."""
    limit = block_size - 1 - seq % block_size
    return [i for i in range(tree.size) if tree.depths[i] <= limit]


def _subtree(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The nodes `keep` (each after its parent, closed under ancestors) as a tree of their own."""
    new = {old: i for i, old in enumerate(keep)}
    return DraftTree(tree.tokens[keep], [-1] + [new[tree.parents[old]] for old in keep[1:]],
                     [tree.depths[old] for old in keep], [-1] * len(keep))


def _root_to_leaf_paths(tree: DraftTree) -> list[list[int]]:
    children = tree.children()
    paths, stack = [], [[0]]
    while stack:
        path = stack.pop()
        kids = children[path[-1]]
        if not kids:
            paths.append(path)
        stack.extend(path + [c] for c in reversed(kids))
    return paths


class _RoundView:
    """A round's captures by node: rows[node] = (hidden [E], keys [L, H_kv, d], values), heads[node]
    = (argmax, logits [V] or None); the first capture holding a node gives it."""

    def __init__(self, want_logits: bool) -> None:
        self.want_logits = want_logits
        self.rows: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self.heads: dict[int, tuple[int, Tensor | None]] = {}
        self.without_hidden: set[int] = set()  # nodes whose K/V the prefix cache gave (no hidden state)

    def add(self, p: int, capture: dict, node_of: Callable[[int, int], int]) -> None:
        if capture["row_positions"]:
            hidden, keys, values = unpack(capture["hidden"]), unpack(capture["keys"]), unpack(capture["values"])
            cached = set(capture.get("rows_without_hidden", ()))
            for k, pos in enumerate(capture["row_positions"]):
                if node_of(p, pos) not in self.rows:
                    self.rows[node_of(p, pos)] = (hidden[k], keys[:, k], values[:, k])
                    if pos in cached:
                        self.without_hidden.add(node_of(p, pos))
        logits = unpack(capture["logits"]) if self.want_logits and capture["head_positions"] else None
        for k, pos in enumerate(capture["head_positions"]):
            self.heads.setdefault(node_of(p, pos), (capture["argmax"][k], None if logits is None else logits[k]))

    def argmax(self, node: int) -> int:
        return self.heads[node][0]

    def logits(self, nodes: list[int]) -> Tensor:
        return torch.stack([self.heads[node][1] for node in nodes])  # [n, V]

    def target_output(self, nodes: list[int]) -> TargetOutput:
        """The nodes' rows, in order, as a TargetOutput over those tokens: per-layer K/V
        L x [1, H_kv, n, d] and final post-norm hidden states [1, n, E] (None when a node's row came
        from the prefix cache; no logits: not needed)."""
        hidden = None if self.without_hidden.intersection(nodes) else \
            torch.stack([self.rows[node][0] for node in nodes]).unsqueeze(0)  # [1, n, E]
        keys = torch.stack([self.rows[node][1] for node in nodes], dim=2)  # [L, H_kv, n, d]
        values = torch.stack([self.rows[node][2] for node in nodes], dim=2)
        return TargetOutput(logits=None, hidden_states=[None] * keys.shape[0] + [hidden],
                            keys=[k.unsqueeze(0) for k in keys.unbind(0)],
                            values=[v.unsqueeze(0) for v in values.unbind(0)])
