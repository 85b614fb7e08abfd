"""The client: drafts on this device, has the server's target verify, streams the tokens, and
keeps generating when the connection is gone.

    client = RemoteDraftingClient("http://server:8000", drafter, target, token=...)
    for event in client.stream(prompt_ids, max_tokens=128):      # StreamEvent
        ...                                                       # verified / unverified / rollback
    result = client.generate(prompt_ids, 128)                     # ClientResult

One round: the local drafter proposes a chain (or an EAGLE-2 tree) from the verified state, the
server verifies it (one HTTP call) and returns the accepted tokens, its own next token and the
drafter-sync payload, which rolls the local drafter forward (serving/local.py). The draft depth
follows the measured round-trip time and acceptance (serving/adaptive.py). A client asked for
trees drafts each round the tree or a chain, whichever has measured more tokens per second
(`chain_if_faster`, as the vLLM engine's moa_tree option: decoding/speed_control.FasterShape, each
shape with its own depth controller). A session's first round drafts no further than the server
verifies it (/v1/info `kv_block_size`: the root's KV block on the vLLM backend). A session's open
asks only for the sync rows the drafter will read (`rows_wanted_from`: a windowed MoA's last W).

Lost connection (timeout, refused, reset, truncated response, 5xx): the client goes offline and
keeps drafting alone, emitting `unverified` tokens, retrying with exponential backoff (jittered,
seeded). Back online it verifies the unverified tail in chunks of at most the server's
max_draft_nodes; at the first rejected token it emits `rollback` and continues from the target's
token. A verify that reached the server but whose answer was lost is harmless: requests name
their position (`seq`) and the server answers from there (protocol.py). A session the server no
longer has (404: expired, restarted; 409: out of step) is reopened with the verified prefix.

Greedy output is the target's greedy output, nothing lost or duplicated; `ClientResult` says how
many leading tokens the target verified (unverified ones can remain only when the server stayed
unreachable for `give_up_after_s`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence

import tenacity
import torch

from vllm_moa import registry as kinds
from vllm_moa.decoding.retrieval import Retrieval, lookup_alone, lookup_found, lookup_merged, lookup_options
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.decoding.speed_control import FasterShape
from vllm_moa.decoding.tree import DraftSpec, DraftTree
from vllm_moa.registry import DrafterArg
from vllm_moa.serving.adaptive import DraftController
from vllm_moa.serving.api_call import api_events
from vllm_moa.serving.local import decode_sync, open_local, propose
from vllm_moa.serving.pipeline import Round, RoundSender, continues, drafted_chain, lookup_ahead, pipeline_pays
from vllm_moa.serving.protocol import InfoResponse, OpenResponse, VerifyResponse
from vllm_moa.serving.run_state import RunState, advance
from vllm_moa.serving.stream import (
    ClientResult,
    ProtocolError,
    RequestRefused,
    ServerUnavailable,
    StreamEvent,
    Transcript,
)
from vllm_moa.serving.transport import StaleSession, TransientFailure, Transport, payload_errors
from vllm_moa.target import TargetModel

TREE, CHAIN = "tree", "chain"

__all__ = ["ClientResult", "ProtocolError", "RemoteDraftingClient", "RequestRefused", "ServerUnavailable",
           "StreamEvent", "Transcript"]

class RemoteDraftingClient:
    """Speculative decoding against a verification server (see the module docstring).

    drafter:  a drafter object of a kind that drafts on a client (a loaded MoA, EAGLE-style or
              independent drafter, NgramDrafter or "ngram"), or NoDrafter / None for the plain
              "API call" baseline (/v1/generate, streamed; nothing is produced while disconnected)
    target:   a local TargetModel for the drafter's shared parts (embedding, LM head, last TLI
              layers); needed by MoA and EAGLE. Its other layers never run here.
    num_draft: fixed draft depth, or None to adapt it to round-trip time and acceptance
    tree_top_k: draft EAGLE-2 trees this wide (depth adaptive) instead of chains
    chain_if_faster: with tree_top_k, each round drafts the tree or a chain, whichever has measured
              more tokens per second (both tried first, the other re-tried now and then); False:
              the tree every round
    pipeline: rounds in flight at most (pipeline.py): a chain's next round is drafted past it and
              sent before its verdict while that measurably pays; 1: every round waits for the
              verdict before it
    lookup:   n-gram matches in the prompt and the verified text merged into a model drafter's
              drafts, or drafted alone when long enough (decoding/retrieval.py), as in the
              runtime: on by default for model drafters; False, or a dict / Retrieval of options
    """

    def __init__(self, url: str, drafter: DrafterArg, target: TargetModel | None = None, *,
                 token: str | None = None, encoding: str = "fp16", num_draft: int | None = None,
                 tree_top_k: int | None = None, max_depth: int = 16, timeout: float = 10.0,
                 connect_timeout: float = 3.0, backoff_s: float = 0.05, backoff_max_s: float = 2.0,
                 max_unverified: int = 256, offline_chunk: int = 4, give_up_after_s: float = 60.0,
                 seed: int = 0, tokenizer=None, lookup: bool | dict | Retrieval = True,
                 chain_if_faster: bool = True, pipeline: int = 2) -> None:
        if encoding not in ("fp16", "int8"):
            raise ValueError(f"encoding must be fp16 or int8, got {encoding!r}")
        if num_draft is not None and num_draft < 1:
            raise ValueError(f"num_draft must be >= 1, got {num_draft}")
        if not isinstance(pipeline, int) or pipeline < 1:
            raise ValueError(f"pipeline (rounds in flight) must be an integer >= 1, got {pipeline!r}")
        if tree_top_k is not None and tree_top_k < 1:
            raise ValueError(f"tree_top_k must be >= 1, got {tree_top_k}")
        drafter = kinds.as_drafter(drafter)
        kind = kinds.kind_of(drafter)
        self.drafts = kind.runtime_session is not None  # a kind that drafts at all (not "none")
        self.retrieval = lookup_options(lookup, model_free=kind.model_free)
        if self.drafts:
            open_local(drafter, target)  # refuses a drafter that cannot run here, before any call
        self.drafter, self.target, self.tokenizer = drafter, target, tokenizer
        self.encoding, self.num_draft, self.tree_top_k, self.max_depth = encoding, num_draft, tree_top_k, max_depth
        self.chain_if_faster = chain_if_faster
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.max_unverified, self.offline_chunk, self.give_up_after_s = max_unverified, offline_chunk, give_up_after_s
        self.transport = Transport(url, token, timeout, connect_timeout)
        self.pipeline = pipeline
        self.sender = RoundSender(self.transport, workers=2 * pipeline + 1)  # + discarded rounds' answers
        self._rng = random.Random(seed)
        self._info: InfoResponse | None = None

    def close(self) -> None:
        self.sender.close()
        self.transport.close()

    def __enter__(self) -> RemoteDraftingClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- public API -----------------------------------------------------------------------------
    def info(self) -> InfoResponse:
        """The server's /v1/info (cached), retried until give_up_after_s."""
        if self._info is None:
            self._info = self._retrying(lambda: self.transport.call("GET", "/v1/info", None, InfoResponse))
        return self._info

    def generate(self, prompt_ids: Sequence[int], max_tokens: int = 128, sampling: SamplingParams | None = None,
                 seed: int | None = None, eos_token_id: int | None = None,
                 on_event: Callable[[StreamEvent], None] | None = None) -> ClientResult:
        for event in self.stream(prompt_ids, max_tokens, sampling, seed, eos_token_id):
            if on_event is not None:
                on_event(event)
            if event.kind == "done":
                return event.result
        raise AssertionError("stream ended without a result")  # pragma: no cover

    def stream(self, prompt_ids: Sequence[int], max_tokens: int = 128, sampling: SamplingParams | None = None,
               seed: int | None = None, eos_token_id: int | None = None) -> Iterator[StreamEvent]:
        """Events in order; the last is `done` with the ClientResult."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty: give at least one token")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        sampling = None if sampling is None or sampling.greedy else sampling
        generator = None
        if sampling is not None:
            generator = torch.Generator().manual_seed(seed if seed is not None else self._rng.randrange(2**62))
        run = RunState(prompt, max_tokens, eos_token_id, sampling, generator, seed, ClientResult([], 0))
        started = time.perf_counter()
        calls0, sent0, received0 = self.transport.calls, self.transport.bytes_sent, self.transport.bytes_received
        events = self._spec_events(run) if self.drafts else api_events(self, run)
        first = True
        try:
            for event in events:
                if first and event.kind == "verified":
                    run.result.ttft, first = time.perf_counter() - started, False
                yield event
        finally:
            events.close()
            result = run.result
            result.token_ids, result.num_verified = list(run.out), run.nv
            result.seconds = time.perf_counter() - started
            result.calls = self.transport.calls - calls0
            result.bytes_sent = self.transport.bytes_sent - sent0
            result.bytes_received = self.transport.bytes_received - received0
            if self.tokenizer is not None:
                result.text = self.tokenizer.decode(run.out)
        yield StreamEvent("done", len(run.out), result=run.result)

    # -- speculative generation ---------------------------------------------------------------------
    def _spec_events(self, run: RunState) -> Iterator[StreamEvent]:
        info = self.info()
        context = info.context_window
        if context is not None and len(run.prompt) + run.max_tokens > context:
            raise ValueError(f"prompt ({len(run.prompt)} tokens) + max_tokens={run.max_tokens} exceeds the target's "
                             f"context window ({context})")
        max_nodes = info.limits.max_draft_nodes
        run.pipeline = min(self.pipeline, info.limits.max_rounds_in_flight + 1)  # all but the first may wait there
        run.local = open_local(self.drafter, self.target)
        top_k = self.tree_top_k
        max_depth = min(self.max_depth, max_nodes)
        run.controllers = {CHAIN: DraftController(max_depth, fixed=self.num_draft)}
        if top_k:
            run.controllers[TREE] = DraftController(max_depth, fixed=self.num_draft,
                                                    nodes=lambda k: min(max_nodes, k * top_k))
            run.shape = TREE
            if self.chain_if_faster:
                run.shapes = FasterShape([TREE, CHAIN])
        run.controller = run.controllers[run.shape]
        try:
            first = self._retrying(lambda: self._open(run))
            yield from advance(run, [], 0, [first], 1)
            while not run.done:
                if run.offline and time.monotonic() - run.offline_since > self.give_up_after_s:
                    run.result.finish_reason = "disconnected"
                    return
                if run.offline and time.monotonic() < run.next_try:
                    event = self._offline_step(run)
                    if event is not None:
                        yield event
                    else:
                        time.sleep(max(0.0, min(run.next_try - time.monotonic(), 0.25)))
                    continue
                yield from self._online_step(run, max_nodes, context)
        finally:
            run.inflight.clear()  # rounds still in flight are answered to nobody
            self._close_session(run)

    def _open(self, run: RunState) -> int:
        rows_from = run.local.rows_wanted_from(len(run.prompt))  # a windowed MoA drafter reads the last W rows
        body = {"prompt": run.prompt, "drafter": run.local.declaration().model_dump(), "encoding": self.encoding,
                "sampling": self.sampling_body(run), **({"sync_from": rows_from} if rows_from else {})}
        response = self.transport.call("POST", "/v1/sessions", body, OpenResponse)
        run.result.server_seconds += response.server_ms / 1e3
        sync = self._decode(response.sync, rows_from, len(run.prompt) - rows_from)
        first = self.checked_token(response.first_token, "first token")
        with payload_errors():
            run.local.start(run.prompt, sync)
        run.session_id, run.seq, run.first_round = response.session_id, response.length, True
        if run.seq != len(run.prompt):
            raise ProtocolError(f"server ran {run.seq} prompt tokens, the prompt has {len(run.prompt)}")
        return first

    def _reopen(self, run: RunState) -> None:
        """The server lost the session (or we are out of step): open one at our verified prefix."""
        self._close_session(run)
        prefix = run.prompt + run.out[: run.nv - 1]
        body = {"prompt": prefix, "pending": run.out[run.nv - 1], "sync_from": run.seq,
                "drafter": run.local.declaration().model_dump(), "encoding": self.encoding,
                "sampling": self.sampling_body(run, salt=run.result.reopens + 1)}
        response = self.transport.call("POST", "/v1/sessions", body, OpenResponse)
        if response.length != run.seq or response.first_token != run.out[run.nv - 1] or response.sync.count:
            raise ProtocolError("reopened session does not match the client's verified prefix")
        run.session_id, run.first_round = response.session_id, True
        run.result.reopens += 1

    def _close_session(self, run: RunState) -> None:
        if run.session_id is None:
            return
        session_id, run.session_id = run.session_id, None
        if run.offline:
            return  # the server expires it (idle TTL); do not wait on a dead link
        try:
            self.transport.call("DELETE", f"/v1/sessions/{session_id}", None, None, stale=(404,))
        except (TransientFailure, StaleSession, RequestRefused):
            pass

    def sampling_body(self, run: RunState, salt: int = 0) -> dict:
        if run.sampling is None:
            return {"temperature": 0.0}
        seed = None if run.seed is None else (run.seed * 1_000_003 + salt) % 2**62
        return {"temperature": run.sampling.temperature, "top_k": run.sampling.top_k, "top_p": run.sampling.top_p,
                "seed": seed}

    def _decode(self, sync, start: int, count: int):
        if sync.start != start or sync.count != count:
            raise ProtocolError(f"sync payload covers {sync.start}+{sync.count}, expected {start}+{count}")
        target = self.target
        with payload_errors():
            return decode_sync(sync, target.dtype if target is not None else torch.float32,
                               target.device if target is not None else torch.device("cpu"),
                               target.signature if target is not None else None)

    def checked_token(self, token, what: str) -> int:
        """A token id from the server, checked against its target's vocabulary."""
        vocab = self._info.target.get("vocab_size") if self._info is not None else None
        if isinstance(token, bool) or not isinstance(token, int) or token < 0 or (
                isinstance(vocab, int) and token >= vocab):
            raise ProtocolError(f"the server's {what} {token!r} is not a token id of its target's vocabulary "
                                f"[0, {vocab if isinstance(vocab, int) else '?'})")
        return token

    def _online_step(self, run: RunState, max_nodes: int, context: int | None) -> Iterator[StreamEvent]:
        if not run.inflight:
            self._send_round(run, max_nodes, context)
        self._pipeline(run, max_nodes, context)
        head = run.inflight[0]
        try:
            response = head.future.result()
        except TransientFailure:
            self._abandon(run)
            self.went_offline(run)
            return
        except RequestRefused as err:
            if head.after is None or err.status != 429:
                raise
            self._abandon(run)  # the server holds fewer rounds waiting than we sent: stop pipelining
            run.pipeline = 1
            return
        except StaleSession as err:
            self._abandon(run)
            run.stale += 1
            if run.stale > 3:
                raise ProtocolError(f"the server keeps refusing a freshly reopened session: {err}") from None
            try:
                self._reopen(run)
            except TransientFailure:
                self.went_offline(run)
            return
        run.inflight.popleft()
        now = time.perf_counter()
        wall, run.last_verdict = now - max(head.sent, run.last_verdict), now
        run.offline, run.failures, run.stale, run.first_round = False, 0, 0, False
        if head.chained:
            run.local.begin()  # its chain was fed past the verified state: rebuild from there
        yield from self._accept(run, head, response, wall)
        if run.inflight:
            following = run.inflight[0]
            if run.done or not continues(head, response, following):
                run.inflight.clear()  # the server refuses them (409): their answers are dropped

    def _send_round(self, run: RunState, max_nodes: int, context: int | None) -> None:
        """The round from the verified state: a fresh draft, or the unverified tail (a resync)."""
        pending, tail = run.out[run.nv - 1], run.out[run.nv:]
        room = max_nodes if context is None else max(0, min(max_nodes, context - 1 - run.seq))
        block = self.info().kv_block_size
        if run.first_round and block:  # the server verifies no node past the root's KV block there
            room = min(room, block - 1 - run.seq % block)
        draft_s = None
        if tail:  # resync: the unverified tail, at most `room` of it
            run.local.begin()
            tree = DraftTree.chain(pending, tail[:room], fed=0) if room else DraftTree.single(pending)
        else:
            if run.shapes is not None:
                run.shape = run.shapes.choose(1)
                run.controller = run.controllers[run.shape]
            depth = min(run.controller.choose(limit=run.max_tokens - run.nv), room)
            t0 = time.perf_counter()
            if depth == 0:
                run.local.begin()
                tree = DraftTree.single(pending)
            else:
                spec = DraftSpec.tree(depth, self.tree_top_k, budget=min(room, depth * self.tree_top_k)) \
                    if run.shape == TREE else DraftSpec.chain(depth)
                tree = self._draft(run, pending, spec, room)
            draft_s = time.perf_counter() - t0
            run.result.draft_seconds += draft_s
        run.inflight.append(self._send(run, run.seq, tree, draft_s))

    def _send(self, run: RunState, seq: int, tree: DraftTree, draft_s: float | None, after: Round | None = None) -> Round:
        run.rounds += 1
        return self.sender.send(run.session_id, run.rounds, seq, tree, draft_s, after)

    def _pipeline(self, run: RunState, max_nodes: int, context: int | None) -> None:
        """Send rounds behind the chains in flight while one more pays (pipeline.py), up to
        `pipeline` rounds in flight: each drafted past the last, from a guess of the target's next
        token there: lookup's continuation when it has one long enough (free), else the drafter's."""
        while len(run.inflight) < run.pipeline and not run.first_round:
            last = run.inflight[-1]
            chain = drafted_chain(run.inflight)
            seq, end = last.seq + last.tree.size, run.nv + len(chain)  # the new root's position, and its index + 1
            if last.draft_s is None or not last.is_chain or run.eos in chain or end >= run.max_tokens:
                return
            controller, room = run.controller, max_nodes if context is None else min(max_nodes, context - 1 - seq)
            depth = min(controller.choose(limit=run.max_tokens - end), room)
            saved = controller.flight_time(depth)
            if depth < 1 or not pipeline_pays(controller.rate, len(chain), saved, 0.0):
                return  # not even a round that costs nothing to draft
            t0 = time.perf_counter()
            new = lookup_ahead(self.retrieval, run.prompt + run.out[: run.nv - 1], chain, depth + 1)
            if not new and not pipeline_pays(controller.rate, len(chain), saved, controller.draft_time(depth + 1)):
                return
            if not new:
                for r in run.inflight:  # accepted from the verified state: the drafter is fed past it now
                    if not r.chained:
                        r.chained, r.tree = True, DraftTree.chain(r.root, r.tree.tokens[1:].tolist(), fed=0)
                run.local.rollback()
                new = run.local.draft_ahead(chain, depth + 1, stop_token=run.eos)
            draft_s = time.perf_counter() - t0
            run.result.draft_seconds += draft_s
            if len(new) < 2 or new[-1] == run.eos:
                return
            run.inflight.append(self._send(run, seq, DraftTree.chain(new[0], new[1:], fed=0), draft_s, after=last))
            run.result.pipelined_rounds += 1

    def _abandon(self, run: RunState) -> None:
        """The rounds in flight are lost (the link, a stale session): the state is the verified one."""
        run.inflight.clear()
        run.local.rollback()

    def _draft(self, run: RunState, pending: int, spec: DraftSpec, room: int) -> DraftTree:
        """A fresh round's draft: the local drafter's, with lookup over the prompt and the verified
        tokens merged in (at most `room` drafted nodes), or lookup's alone when it found enough."""
        if self.retrieval is None:
            return propose(run.local, pending, spec)
        found = lookup_found(self.retrieval, run.prompt + run.out[: run.nv - 1], pending, spec)
        alone = lookup_alone(self.retrieval, pending, spec, found)
        if alone is not None:
            run.local.begin()  # the drafter runs over the accepted tokens when their rows arrive
            run.result.lookup_rounds["retrieval"] += 1
            return alone
        tree = propose(run.local, pending, spec)
        merged = lookup_merged(self.retrieval, tree, found, spec, max_new=room - (len(tree.tokens) - 1))
        run.result.lookup_rounds["model" if merged is None else "merged"] += 1
        return tree if merged is None else merged

    def _accept(self, run: RunState, head: Round, response: VerifyResponse, wall: float) -> Iterator[StreamEvent]:
        """`head`'s verdict: `wall` is the time since it went out or since the verdict before it
        (the later for a pipelined round, whose drafting and flight overlapped earlier rounds)."""
        tree, fresh, draft_s, pipelined = head.tree, head.draft_s is not None, head.draft_s, head.after is not None
        tokens, path = tree.tokens.tolist(), response.path
        if (not path or path[0] != 0 or any(not 0 < n < len(tokens) for n in path[1:])
                or any(tree.parents[b] != a for a, b in zip(path, path[1:]))
                or response.accepted != [tokens[n] for n in path[1:]] or response.seq != run.seq + len(path)):
            raise ProtocolError(f"verify response does not fit the draft: path {path}, seq {response.seq}")
        sync = self._decode(response.sync, run.seq, len(path))
        nxt = self.checked_token(response.next_token, "next token")
        with payload_errors():
            run.local.accept(tree, path, sync)
        run.seq = response.seq
        depth = max(tree.depths)
        result = run.result
        result.server_seconds += response.server_ms / 1e3
        result.verify_calls += 1
        if fresh:
            result.accepted_per_verify.append(len(path))
            result.drafted_per_verify.append(depth)
            result.shape_rounds[run.shape] = result.shape_rounds.get(run.shape, 0) + 1
            run.controller.observe_acceptance(depth, len(path) - 1)
            if run.shapes is not None:  # the round's tokens over its time, drafting included
                run.shapes.observe(1, run.shape, len(path), wall + (0.0 if pipelined else draft_s or 0.0))
        if pipelined:
            result.pipelined_verified += 1
        else:
            run.controller.observe_timing(depth, wall, response.server_ms / 1e3, draft_s)
        old_out, old_nv = list(run.out), run.nv
        accepted = response.accepted
        if fresh:
            out, nv = run.out + accepted + [nxt], run.nv + len(accepted) + 1
        else:
            nv = run.nv + len(accepted)  # the accepted drafts are the tail's first tokens
            confirmed = len(accepted)
            if nv < len(run.out) and run.out[nv] == nxt:  # the target's token is the tail's next one
                out, nv, confirmed = run.out, nv + 1, confirmed + 1
            else:  # roll back from the first rejected token, continue from the target's
                dropped = len(run.out) - nv
                out, nv = run.out[:nv] + [nxt], nv + 1
                if dropped:
                    result.rollbacks += 1
                    result.rolled_back_tokens += dropped
            result.offline_confirmed += confirmed
        yield from advance(run, old_out, old_nv, out, nv)

    def _offline_step(self, run: RunState) -> StreamEvent | None:
        """Draft a few tokens alone; None when there is nothing (more) to draft."""
        tail = len(run.out) - run.nv
        room = min(run.max_tokens - len(run.out), self.max_unverified - tail)
        if room <= 0 or (tail and run.out[-1] == run.eos):
            return None
        t0 = time.perf_counter()
        new = run.local.draft_ahead(run.out[run.nv - 1:], min(self.offline_chunk, room), run.sampling,
                                    run.generator, stop_token=run.eos)
        run.result.draft_seconds += time.perf_counter() - t0
        if not new:
            return None
        start = len(run.out)
        run.out.extend(new)
        run.result.offline_tokens += len(new)
        return StreamEvent("unverified", start, new)

    def went_offline(self, run: RunState) -> None:
        run.result.failures += 1
        run.failures += 1
        if not run.offline:
            run.offline, run.offline_since = True, time.monotonic()
            run.result.disconnects += 1
        run.next_try = time.monotonic() + self._backoff(run.failures)

    def _backoff(self, failures: int) -> float:
        """Seconds to wait after `failures` consecutive failures: exponential, capped, jittered
        (seeded: a client's retries are reproducible)."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** (failures - 1)) * self._rng.uniform(0.75, 1.25)

    def _retrying(self, call: Callable[[], object]):
        """Run `call` until it does not fail transiently, with backoff, for give_up_after_s."""

        def give_up(state: tenacity.RetryCallState):
            raise ServerUnavailable(f"server unreachable for {self.give_up_after_s:.0f}s: "
                                    f"{state.outcome.exception()}") from None

        retrying = tenacity.Retrying(retry=tenacity.retry_if_exception_type((TransientFailure, StaleSession)),
                                     stop=tenacity.stop_after_delay(self.give_up_after_s),
                                     wait=lambda state: self._backoff(state.attempt_number),
                                     sleep=lambda seconds: time.sleep(seconds), retry_error_callback=give_up)
        return retrying(call)
