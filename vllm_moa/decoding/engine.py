"""The speculative decoding engine on transformers: a batch of requests of different lengths,
any drafter, chains or EAGLE-2 trees, greedy or lossless sampling, per-sequence stopping, metrics.

One round for the active sequences of the batch:

    each session drafts a tree rooted at its pending token           (decoding/drafters.py)
    the trees are padded into one target forward over a slot cache    (tree.verification_inputs)
    per sequence: accept a path (verify.py), compact the target cache to it (cache.py), roll the
    drafter forward, emit the accepted tokens + the target's next token, check stops

At temperature 0 the output of every sequence equals the target's own greedy decoding token for
token, whatever the drafter, the tree or the batch (tests/unit/test_engine.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vllm_moa import registry as kinds
from vllm_moa.decoding import target_slices
from vllm_moa.decoding.cache import SlotKVCache
from vllm_moa.decoding.drafters import DraftSession, accept_all, drafts_together, propose_all
from vllm_moa.decoding.results import GenerationResult
from vllm_moa.decoding.retrieval import HybridSession, Retrieval, max_extra_nodes
from vllm_moa.decoding.sampling import SamplingParams, make_generator, pick
from vllm_moa.decoding.speed_control import SpeedController
from vllm_moa.decoding.tree import DraftSpec, DraftTree, verification_inputs
from vllm_moa.decoding.verify import greedy_accept, sampled_accept
from vllm_moa.registry import DrafterArg
from vllm_moa.target import TargetModel, TargetOutput


@dataclass
class _Sequence:
    index: int
    prompt: list[int]
    max_tokens: int
    session: DraftSession | None
    result: GenerationResult
    pending: int = -1
    emitted: int = 0
    done: bool = False
    lag: list[tuple[int, target_slices.PlainRound, int]] = field(default_factory=list)  # plain rounds the drafter has not
    # seen: (token, that round's target outputs, the sequence's row in it)
    unstarted: TargetOutput | None = None  # the prompt's target output (no logits) while the session waits to start

    def lagged_round(self, device: torch.device) -> tuple[DraftTree, list[int], TargetOutput]:
        """The tokens of the plain rounds since the drafter last drafted, as one accepted chain of
        nodes it was never fed (tree, path, the target's output there), for accept(); the lag is
        cleared and the session told that this round was not drafted."""
        tokens = [token for token, _, _ in self.lag]
        verified = target_slices.lag_outputs(self.lag)
        self.lag = []
        self.session.skip_round()
        return DraftTree.chain(tokens[0], tokens[1:], device, fed=0), list(range(len(tokens))), verified

    @property
    def tokens(self) -> list[int]:
        return self.result.token_ids


class SpeculativeEngine:
    """target + drafter (any kind's drafter object: a loaded drafter, NgramDrafter, NoDrafter for
    plain decoding through the same batched loop; None and "ngram" are accepted for the latter
    two) + what to draft each round (+ `retrieval`: lookup merged into a model drafter's trees,
    decoding/retrieval.py; + `adaptive`: each round's depth, plain decoding included, chosen from
    measured costs and acceptance, decoding/speed_control.py, one controller for all the engine's
    calls, so what one call measured decides the next call's first rounds, and
    `catch_up_window`: when drafting resumes after more plain-decoded tokens than this (prompt
    included), a session that can start from a suffix starts afresh from the last that many
    instead of reading them all, None: always all; + `batch_drafting`: a batch's
    sequences drafted together where their kind can, one drafter forward per tree level, False:
    one sequence at a time, as at batch 1)."""

    def __init__(self, target: TargetModel, drafter: DrafterArg, spec: DraftSpec | None = None, tokenizer=None,
                 retrieval: Retrieval | None = None, adaptive: bool = False, batch_drafting: bool = True,
                 catch_up_window: int | None = 64) -> None:
        self.target, self.tokenizer = target, tokenizer
        self.drafter = kinds.as_drafter(drafter)
        kind = kinds.kind_of(self.drafter)
        self.drafts = kind.runtime_session is not None
        self.spec = spec or DraftSpec.chain(4)
        if retrieval is not None and kind.model_free:
            raise ValueError(f"retrieval merges lookup into a model drafter's trees; a {kind.name} drafter has none "
                             "(n-gram lookup alone is the 'ngram' drafter)")
        self.retrieval, self.adaptive, self.batch_drafting = retrieval, adaptive, batch_drafting
        if catch_up_window is not None and (not isinstance(catch_up_window, int) or catch_up_window < 1):
            raise ValueError(f"catch_up_window must be a positive number of tokens or None, got {catch_up_window!r}")
        self.catch_up_window = catch_up_window
        # adaptive: the costs (per batch size) and acceptance measured so far, kept across calls
        self.controller: SpeedController | None = _speed_controller(self.spec) if adaptive and self.drafts else None
        config = getattr(target.hf_model, "config", None)
        self.context_window: int | None = getattr(config, "max_position_embeddings", None)

    @property
    def drafts_together(self) -> bool:
        """Whether a batch's sequences draft together (one drafter forward per tree level) with
        this engine's drafter (decoding/drafters.propose_all)."""
        if not (self.drafts and self.batch_drafting):
            return False
        return drafts_together([_open_session(self.drafter, self.target, self.retrieval) for _ in range(2)])

    # -- validation: before any work ---------------------------------------------------------
    def check_request(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                      stop: Sequence[str] | None) -> None:
        if not prompts:
            raise ValueError("prompts is empty: give at least one prompt")
        vocab = self.target.vocab_size
        for i, (prompt, budget) in enumerate(zip(prompts, max_tokens)):
            if not prompt:
                raise ValueError(f"prompt {i} is empty: give at least one token")
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
                raise ValueError(f"prompt {i} has token ids outside the target's vocabulary [0, {vocab})")
            if not isinstance(budget, int) or budget <= 0:
                raise ValueError(f"max_tokens must be a positive integer, got {budget!r} for prompt {i}")
            if self.context_window is None:
                continue
            if len(prompt) >= self.context_window:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens: longer than the target's context window "
                                 f"({self.context_window})")
            if len(prompt) + budget > self.context_window:
                raise ValueError(f"max_tokens={budget} with a {len(prompt)}-token prompt exceeds the context "
                                 f"window ({self.context_window})")
            nodes = self.spec.max_nodes + max_extra_nodes(self.retrieval, self.spec)
            if self.drafts and nodes + 1 > self.context_window - len(prompt):
                raise ValueError(f"tree budget {nodes} (+1 root, retrieval's nodes included) is larger than the "
                                 f"{self.context_window - len(prompt)} positions the context window leaves "
                                 f"after prompt {i}")
        if stop:
            if self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer (SpeculativeEngine(..., tokenizer=...))")
            if any(not isinstance(s, str) or not s for s in stop):
                raise ValueError(f"stop must be non-empty strings, got {list(stop)!r}")

    # -- generation -----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int | Sequence[int] = 64,
                 sampling: SamplingParams | None = None, seed: int | None = None,
                 eos_token_id: int | None = None, stop: Sequence[str] | None = None,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[GenerationResult]:
        """Generate for every prompt (token ids). `on_tokens(i, tokens)` streams request i's
        tokens as soon as the target has verified them; they add up to its `token_ids`."""
        budgets = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        if len(budgets) != len(prompts):
            raise ValueError(f"max_tokens has {len(budgets)} entries for {len(prompts)} prompts")
        batch = self.start(prompts, budgets, sampling, seed, eos_token_id, stop, on_tokens)
        while batch.step():
            pass
        return batch.results

    def start(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
              sampling: SamplingParams | None = None, seed: int | None = None,
              eos_token_id: int | None = None, stop: Sequence[str] | None = None,
              on_tokens: Callable[[int, list[int]], None] | None = None) -> GenerationBatch:
        """Validate the requests and prefill them; `step()` the returned batch to decode."""
        self.check_request(prompts, max_tokens, stop)
        return GenerationBatch(self, prompts, max_tokens, sampling, seed, eos_token_id, stop, on_tokens)


class GenerationBatch:
    """The requests of one `generate` call in flight: their drafting sessions, the target's slot
    cache over the still-active ones, and their results. `step()` runs one round."""

    def __init__(self, engine: SpeculativeEngine, prompts, budgets, sampling, seed, eos_token_id, stop,
                 on_tokens) -> None:
        self.target, self.drafter, self.spec, self.tokenizer = engine.target, engine.drafter, engine.spec, engine.tokenizer
        self.drafts, self.batch_drafting = engine.drafts, engine.batch_drafting
        self.retrieval, self.catch_up_window = engine.retrieval, engine.catch_up_window
        device = self.target.device
        self._generator = make_generator(seed, device)
        self._sampling = None if sampling is None or sampling.greedy else sampling
        self._eos, self._stop, self._on_tokens = eos_token_id, list(stop or []), on_tokens
        self._started = time.perf_counter()
        self.sequences = [
            _Sequence(i, list(p), budget, _open_session(self.drafter, self.target, engine.retrieval),
                      GenerationResult([]))
            for i, (p, budget) in enumerate(zip(prompts, budgets))
        ]
        self.controller = engine.controller
        self.cache = SlotKVCache(self.target.num_layers)  # a row per distinct prompt, then per request: _prefill
        with torch.no_grad():
            self._prefill(self.sequences, self.cache)
        self.active = self.sequences
        self._drop_finished()

    @property
    def results(self) -> list[GenerationResult]:
        return [s.result for s in self.sequences]

    @torch.no_grad()
    def step(self) -> bool:
        """One speculative round over the active sequences; False once every request is done."""
        if self.active:
            self._round(self.active, self.cache)
            self._drop_finished()
        return bool(self.active)

    def _drop_finished(self) -> None:
        still = [row for row, s in enumerate(self.active) if not s.done]
        if len(still) < len(self.active):
            self.cache.select_rows(still)
            self.active = [self.active[row] for row in still]

    def _prefill(self, seqs: list[_Sequence], cache: SlotKVCache) -> None:
        """The target over every distinct prompt once (requests repeating a prompt, as n samples of
        one do, share its forward), the cache then holding a row per request; each request's
        first token picked from its prompt's logits, its drafting session started."""
        device = self.target.device
        # while plain rounds are what pays at this batch size, sessions start when drafting does
        defer = self.controller is not None and self.controller.prefers_plain(len(seqs))
        distinct: dict[tuple[int, ...], int] = {}
        source = [distinct.setdefault(tuple(s.prompt), len(distinct)) for s in seqs]  # request -> its prompt's row
        cache.lengths = [0] * len(distinct)
        prompts = [DraftTree.chain(p[0], list(p[1:]), device, fed=0) for p in distinct]
        width = cache.begin_round(max(t.size for t in prompts), device)
        ids, positions, mask = verification_inputs(prompts, cache.lengths, width, device)
        out = self.target(ids, cache, positions, mask)  # logits [distinct prompts, N, V]
        for row, p in enumerate(distinct):
            cache.commit(row, list(range(len(p))))
        cache.select_rows(source)
        for s, row in zip(seqs, source):
            n = len(s.prompt)
            first = self._pick(out.logits[row, n - 1 : n])
            if s.session is not None and defer:
                s.unstarted = target_slices.rows_of(out, row, list(range(n)), logits=False)
            elif s.session is not None:
                t0 = time.perf_counter()
                s.session.start(torch.tensor([s.prompt], device=device), target_slices.rows_of(out, row, list(range(n))))
                s.result.drafter_seconds += time.perf_counter() - t0
            s.result.ttft = time.perf_counter() - self._started
            s.pending = first
            self._emit(s, [first])

    def _round(self, seqs: list[_Sequence], cache: SlotKVCache) -> None:
        device = self.target.device
        depth = None if self.controller is None else self.controller.choose(len(seqs))
        spec = self._spec_at(depth)
        catching_up = 0.0
        if self.drafts and spec is not None and any(s.lag or s.unstarted is not None for s in seqs):
            # the drafter first runs over the prompts and plain rounds' tokens it has not seen, in
            # one call (a cost of those rounds, not of this round's drafting: kept out of the
            # controller's fit)
            t0 = time.perf_counter()
            self._catch_up(seqs, device)
            catching_up = time.perf_counter() - t0
        t0 = time.perf_counter()
        if not self.drafts or spec is None:  # no drafter, or a plain round (the drafter lags)
            trees = [DraftTree.single(s.pending, device) for s in seqs]
        else:
            trees = propose_all([s.session for s in seqs], [s.pending for s in seqs], spec, self._sampling,
                                self._generator, together=self.batch_drafting)
        drafting = self._charge(seqs, time.perf_counter() - t0)
        t0 = time.perf_counter()
        width = cache.begin_round(max(t.size for t in trees), device)
        ids, positions, mask = verification_inputs(trees, cache.lengths, width, device)
        out = self.target(ids, cache, positions, mask)  # logits [B, N, V]
        verifying = time.perf_counter() - t0
        accepted, paths, nexts = [], [], []
        kept = target_slices.PlainRound(out) if spec is None and any(s.session is not None for s in seqs) else None
        for row, (s, tree) in enumerate(zip(seqs, trees)):
            logits = out.logits[row, : tree.size]
            if self._sampling is None:
                path, nxt = greedy_accept(tree, logits)
            else:
                path, nxt = sampled_accept(tree, self._sampling.probs(logits), self._generator)
            cache.commit(row, path)
            paths.append(path)
            nexts.append(nxt)
            if s.session is not None and spec is None:
                s.lag.append((s.pending, kept, row))
            s.result.target_forwards += 1
            s.result.accepted_per_forward.append(len(path))
            s.result.drafted_per_forward.append(max(tree.depths))
            accepted.append(len(path) - 1)
        if self.drafts and spec is not None:
            t0 = time.perf_counter()
            verified = [target_slices.rows_of(out, row, path) for row, path in enumerate(paths)]
            accept_all([s.session for s in seqs], trees, paths, verified, together=self.batch_drafting)
            drafting += self._charge(seqs, time.perf_counter() - t0)
        for s, tree, path, nxt in zip(seqs, trees, paths, nexts):
            s.pending = nxt
            self._emit(s, tree.tokens[path[1:]].tolist() + [nxt])
        if self.controller is not None:
            self.controller.observe(len(seqs), depth, verifying, drafting, accepted, catching_up)

    def _catch_up(self, seqs: list[_Sequence], device: torch.device) -> None:
        window = self.catch_up_window
        for s in seqs:
            backlog = len(s.lag) + (len(s.prompt) if s.unstarted is not None else 0)
            t0 = time.perf_counter()
            if window is not None and backlog > window and getattr(s.session, "starts_from_suffix", False):
                self._restart(s, window, device)
            elif s.unstarted is not None:
                s.session.start(torch.tensor([s.prompt], device=device), s.unstarted)
                s.unstarted = None
            s.result.drafter_seconds += time.perf_counter() - t0
        lagging = [s for s in seqs if s.lag]
        if lagging:
            t0 = time.perf_counter()
            trees, paths, verified = zip(*(s.lagged_round(device) for s in lagging))
            accept_all([s.session for s in lagging], trees, paths, verified, together=self.batch_drafting)
            self._charge(lagging, time.perf_counter() - t0)

    def _restart(self, s: _Sequence, window: int, device: torch.device) -> None:
        """A fresh session for `s`, started from its whole history (lookup reads it all) with the
        target's outputs over its last `window` tokens (what its model reads): the catch-up over a
        long backlog, bounded."""
        history = s.prompt + s.tokens[:-1]  # what the target has run; the last token is pending
        take = min(window, len(s.lag))
        parts = [target_slices.last_tokens(s.unstarted, window - take)] if take < window and s.unstarted is not None else []
        parts += [target_slices.lag_outputs(s.lag[-take:])] if take else []
        s.session = _open_session(self.drafter, self.target, self.retrieval)
        s.session.start(torch.tensor([history], device=device), target_slices.concat_outputs(parts))
        s.unstarted, s.lag = None, []

    @staticmethod
    def _charge(seqs: list[_Sequence], seconds: float) -> float:
        """The drafter's time of a round, shared out evenly among the sequences it drafted for."""
        for s in seqs:
            s.result.drafter_seconds += seconds / len(seqs)
        return seconds

    def _spec_at(self, depth: int | None) -> DraftSpec | None:
        """What to draft at the controller's depth (None: no controller): the engine's spec, a
        shorter chain, or nothing (0: a plain round)."""
        if depth is None or depth == self.spec.depth:
            return self.spec
        return DraftSpec.chain(depth) if depth else None

    def _pick(self, logits: Tensor) -> int:
        """logits [1, V] -> the target's token (greedy or sampled)."""
        return int(pick(logits, self._sampling, self._generator))

    def _emit(self, s: _Sequence, new_tokens: list[int]) -> None:
        """Append verified tokens, apply stops (EOS, max_tokens, stop strings), stream the rest."""
        for token in new_tokens:
            s.tokens.append(token)
            if token == self._eos:
                s.done, s.result.finish_reason = True, "eos"
                break
            if self._stop and self._hit_stop(s):
                s.done, s.result.finish_reason = True, "stop"
                break
            if len(s.tokens) >= s.max_tokens:
                s.done, s.result.finish_reason = True, "length"
                break
        if self._on_tokens is not None and len(s.tokens) > s.emitted:
            self._on_tokens(s.index, s.tokens[s.emitted :])
        s.emitted = len(s.tokens)
        s.result.seconds = time.perf_counter() - self._started
        if s.done and self.tokenizer is not None:
            text = self.tokenizer.decode(s.tokens)
            if s.result.finish_reason == "stop":
                text = text[: min(text.find(x) for x in self._stop if x in text)]
            s.result.text = text

    def _hit_stop(self, s: _Sequence) -> bool:
        longest = max(len(x) for x in self._stop)
        tail = self.tokenizer.decode(s.tokens[-(longest + 8) :])  # a token is at least a byte
        return any(x in tail for x in self._stop)


def _speed_controller(spec: DraftSpec) -> SpeedController:
    """Chains: any depth up to the spec's (N(K) = K nodes); trees: the tree or nothing."""
    if spec.is_chain:
        return SpeedController(list(range(1, spec.depth + 1)), nodes=lambda k: k)
    return SpeedController([spec.depth], nodes=lambda k: spec.max_nodes)


def _open_session(drafter, target: TargetModel, retrieval: Retrieval | None) -> DraftSession | None:
    session = kinds.open_runtime_session(drafter, target)
    return session if retrieval is None or session is None else HybridSession(session, retrieval)
