"""Target backends: where the server's target runs. One interface, two implementations:

* `TransformersBackend` (the default; CPU or one GPU): one `SlotKVCache` per session, draft trees
  verified with the runtime's own primitives (decoding/tree.verification_inputs, verify.py
  greedy_accept / sampled_accept, SlotKVCache.commit), so the server accepts exactly what the local
  engine would. For MoA clients it holds the drafter's LSA/Ekv2E weights only to turn the target's
  per-layer K/V of newly verified tokens into Ekv2E rows (the MoA model's `rows_from_kv`): one E-wide
  row per token instead of 2*L*Ekv raw K/V values.
* `VLLMBackend` (vllm_moa/integration/serve/vllm_backend.py, a layer above: vLLM's engine): each
  round is one vLLM request over the verified prefix and the draft (prefix caching), batched
  with every other session's rounds; the same checks, acceptance and sync (`SessionBackend`).

The transformers backend serialises target forwards by one lock (one forward at a time; requests
of many sessions interleave round by round). Errors meant for the client are `BackendError`s carrying an HTTP status.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from vllm_moa import registry as kinds
from vllm_moa.config import DrafterTargetMismatch, TargetSignature
from vllm_moa.decoding.cache import SlotKVCache
from vllm_moa.decoding.sampling import SamplingParams, sample
from vllm_moa.decoding.tree import DraftTree, verification_inputs
from vllm_moa.decoding.verify import greedy_accept_choices, sampled_accept
from vllm_moa.models import Drafter
from vllm_moa.registry import DrafterKind
from vllm_moa.serving.protocol import (
    DrafterInfo,
    GenerateRequest,
    OpenRequest,
    OpenResponse,
    SamplingOptions,
    SyncPayload,
    VerifyRequest,
    VerifyResponse,
)
from vllm_moa.target import TargetKVCache, TargetModel, TargetOutput


class BackendError(ValueError):
    """A request the backend refuses; `status` is the HTTP status the server answers with."""

    status = 400
    headers: dict[str, str] = {}  # extra response headers (Retry-After)

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status


class Conflict(BackendError):
    """The request contradicts the session's state (stale position, other root, other target)."""

    status = 409


class Superseded(Conflict):
    """A pipelined round whose earlier round did not leave the session where it was drafted from:
    nothing ran; the client discards it (it knows why from the earlier round's verdict)."""


class SessionClosed(BackendError):
    """The session was closed (by its client or by expiry) while the request waited for it."""

    status = 404



def _request_key(request: VerifyRequest) -> tuple:
    """What makes two verify requests the same request (a replay)."""
    return request.seq, tuple(request.tree.tokens), tuple(request.tree.parents)

class BackendUnavailable(RuntimeError):
    """A backend that cannot run here (missing package, not implemented yet)."""


@dataclass
class BackendSession:
    """One sequence on the server. tokens: what the target has run (== cache length); pending:
    its latest choice, the next round's root."""

    tokens: list[int]
    pending: int
    kind: DrafterKind  # the client drafter's kind: what the sync payload carries
    encoding: str
    sampling: SamplingParams | None
    generator: torch.Generator | None
    drafter: Drafter | None = None  # the server's copy of the LSA weights, for kinds that declare LSA
    cache: SlotKVCache | None = None  # the transformers backend's KV cache of this sequence
    live: object | None = None  # the vLLM backend's live request of this sequence
    closed: bool = False
    last_request: tuple | None = None
    last_response: VerifyResponse | None = None
    last_round: int = -1  # the client's number of the latest round answered (VerifyRequest.round)
    lock: threading.Lock = field(default_factory=threading.Lock)


class TargetBackend(ABC):
    """What the server needs from wherever the target runs."""

    name: str
    # a session's first round verifies only the drafted nodes whose positions end in its root's KV
    # block of this many tokens (a backend whose rounds read a prefix cache: vLLM's); None: no bound
    round_block_size: int | None = None

    @property
    @abstractmethod
    def signature(self) -> TargetSignature: ...

    @property
    @abstractmethod
    def context_window(self) -> int | None: ...

    @abstractmethod
    def drafters(self) -> list[DrafterInfo]: ...

    @abstractmethod
    def open(self, request: OpenRequest) -> tuple[BackendSession, OpenResponse]: ...

    @abstractmethod
    def verify(self, session: BackendSession, request: VerifyRequest) -> VerifyResponse: ...

    @abstractmethod
    def generate(self, request: GenerateRequest) -> Iterator[int]:
        """Plain decoding, one token at a time (the "API call" baseline)."""

    @abstractmethod
    def close(self, session: BackendSession) -> None:
        """Free what the session holds."""

    def healthy(self) -> str | None:
        """None while the target can serve; else why not (/v1/health answers 503 with it)."""
        return None

    def shutdown(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release the target (the server's lifespan ends)."""


class SessionBackend(TargetBackend):
    """What every backend shares: the drafters it keeps in sync, the session checks (tokens,
    context window, positions, roots, replays), acceptance and the sync payload. A subclass runs
    the target: `_open_round` (the prompt) and `_verify_round` (one draft tree at a position)."""

    def __init__(self, signature: TargetSignature, vocab_size: int, context: int | None,
                 drafters: dict[str, Drafter] | None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self._signature, self._vocab, self._context = signature, vocab_size, context
        self.device = torch.device(device)
        self.counters: Counter[str] = Counter()  # opens, verifies, replays, rewinds, superseded, generates
        self._counters_lock = threading.Lock()  # sessions of many clients count at once
        # kinds that declare LSA weights (MoA) sync through the server's own copy of those weights
        self._served: list[tuple[DrafterInfo, Drafter | None]] = []
        for name, drafter in (drafters or {}).items():
            drafter.config.target_signature.check_compatible(signature)
            kind = kinds.kind_of(drafter)
            if kind.declares_lsa:
                drafter = drafter.to(device=self.device, dtype=dtype).eval()
                info = DrafterInfo(name=name, kind=kind.name, tli=drafter.tli, lsa_fingerprint=drafter.lsa_fingerprint())
                self._served.append((info, drafter))
            else:
                self._served.append((DrafterInfo(name=name, kind=kind.name), None))

    # -- description --------------------------------------------------------------------------
    @property
    def signature(self) -> TargetSignature:
        return self._signature

    @property
    def context_window(self) -> int | None:
        return self._context

    def drafters(self) -> list[DrafterInfo]:
        return [info for info, _ in self._served]

    # -- sessions -------------------------------------------------------------------------------
    def open(self, request: OpenRequest) -> tuple[BackendSession, OpenResponse]:
        started = time.perf_counter()
        decl = request.drafter
        self._check_tokens(request.prompt, "prompt")
        if request.pending is not None:
            self._check_tokens([request.pending], "pending")
        if self._context is not None and len(request.prompt) >= self._context:
            raise BackendError(f"prompt has {len(request.prompt)} tokens; the target's context window is "
                               f"{self._context}")
        if request.sync_from > len(request.prompt):
            raise BackendError(f"sync_from={request.sync_from} is past the prompt's {len(request.prompt)} tokens")
        if decl.target is not None:
            try:
                TargetSignature(**decl.target.model_dump()).check_compatible(self._signature)
            except DrafterTargetMismatch as err:
                raise Conflict(f"the client's drafter does not match this server's target: {err}") from None
        served = None
        if kinds.get(decl.kind).declares_lsa:
            served = self._find_served(decl.kind, decl.lsa_fingerprint, decl.tli)
        sampling = _sampling(request.sampling)
        generator = None
        if sampling is not None:
            generator = torch.Generator(device=self.device)
            if request.sampling.seed is None:
                generator.seed()
            else:
                generator.manual_seed(request.sampling.seed)
        session = BackendSession(tokens=list(request.prompt), pending=-1, kind=kinds.get(decl.kind),
                                 encoding=request.encoding, sampling=sampling, generator=generator, drafter=served)
        first, sync = self._open_round(session, request)
        session.pending = first
        self._count("opens")
        return session, OpenResponse(session_id="", length=len(request.prompt), first_token=first, sync=sync,
                                     idle_ttl_s=0.0, server_ms=1e3 * (time.perf_counter() - started))

    def verify(self, session: BackendSession, request: VerifyRequest) -> VerifyResponse:
        with session.lock:
            try:
                if request.after is not None:
                    self._check_pipelined(session, request)
                return self._verify(session, request)
            finally:
                if request.round is not None:
                    session.last_round = max(session.last_round, request.round)

    def _check_pipelined(self, session: BackendSession, request: VerifyRequest) -> None:
        """A pipelined round runs only right after its earlier round, where that round left the session."""
        if session.last_request == _request_key(request):
            return  # a replay
        if session.last_round != request.after:
            why = f"follows round {request.after}, but the session's latest round is {session.last_round}"
        elif request.seq != len(session.tokens) or request.tree.tokens[0] != session.pending:
            why = (f"was drafted at {request.seq} from {request.tree.tokens[0]}; round {request.after} left the "
                   f"session at {len(session.tokens)} tokens with next token {session.pending}")
        else:
            return
        self._count("superseded")
        raise Superseded(f"round {request.round} {why}: not verified")

    def _verify(self, session: BackendSession, request: VerifyRequest) -> VerifyResponse:
        started = time.perf_counter()
        if session.closed:
            raise SessionClosed("the session was closed (by its client or by expiry); reopen it")
        tokens, parents = request.tree.tokens, request.tree.parents
        key = _request_key(request)
        if session.last_request == key and session.last_response is not None:
            self._count("replays")
            return session.last_response.model_copy(update={"replayed": True})
        self._check_tokens(tokens, "tree")
        seq, have = request.seq, len(session.tokens)
        if seq > have:
            raise Conflict(f"seq={seq} is ahead of this session: the target has run {have} tokens; reopen the session")
        root = session.pending if seq == have else session.tokens[seq]
        if tokens[0] != root:
            raise Conflict(f"the tree's root token {tokens[0]} at position {seq} is not the target's token there "
                           f"({root}); reopen the session with the verified prefix")
        depths = request.tree.depths()
        if self._context is not None and seq + max(depths) >= self._context:
            raise BackendError(f"a draft of depth {max(depths)} at position {seq} runs past the target's context "
                               f"window ({self._context})")
        tree = DraftTree(torch.tensor(tokens, device=self.device), list(parents), depths, [-1] * len(tokens))
        session.last_request = session.last_response = None  # whatever happens next, no stale replay
        if seq < have:  # cut back to the client's position: the root is the token the target had there
            session.tokens, session.pending = session.tokens[:seq], root
            self._count("rewinds")
        self._count("verifies")
        path, nxt, sync = self._verify_round(session, seq, tree)
        accepted = [tokens[i] for i in path]
        session.tokens.extend(accepted)
        session.pending = nxt
        response = VerifyResponse(seq=len(session.tokens), path=path, accepted=accepted[1:], next_token=nxt,
                                  sync=sync, server_ms=1e3 * (time.perf_counter() - started))
        session.last_request, session.last_response = key, response
        return response

    def close(self, session: BackendSession) -> None:
        """Under the session's lock: a verify in flight finishes first, one that comes after finds
        the session closed (SessionClosed, 404)."""
        with session.lock:
            session.closed = True
            session.cache = None

    @abstractmethod
    def _open_round(self, session: BackendSession, request: OpenRequest) -> tuple[int, SyncPayload]:
        """Run the prompt: (the first token: request.pending or the target's choice, the sync
        payload of positions request.sync_from..)."""

    @abstractmethod
    def _verify_round(self, session: BackendSession, seq: int, tree: DraftTree) -> tuple[list[int], int, SyncPayload]:
        """Verify `tree` rooted at position seq (cutting the session back to seq first): (accepted
        path, next token, the sync payload of the path's nodes)."""

    # -- pieces ---------------------------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        with self._counters_lock:
            self.counters[key] += n

    def _check_generate(self, request: GenerateRequest) -> None:
        self._check_tokens(request.prompt, "prompt")
        if self._context is not None and len(request.prompt) + request.max_tokens > self._context:
            raise BackendError(f"prompt ({len(request.prompt)} tokens) + max_tokens={request.max_tokens} exceeds "
                               f"the target's context window ({self._context})")

    def _check_tokens(self, tokens: list[int], what: str) -> None:
        bad = next((t for t in tokens if t >= self._vocab), None)
        if bad is not None:
            raise BackendError(f"{what} has token id {bad} outside the target's vocabulary [0, {self._vocab})")

    def _find_served(self, kind: str, fingerprint: str | None, tli: int) -> Drafter:
        for info, module in self._served:
            if info.kind == kind and info.lsa_fingerprint == fingerprint and info.tli == tli:
                return module
        label = kinds.get(kind).label
        held = ", ".join(f"{i.name} (tli={i.tli}, lsa {i.lsa_fingerprint})" for i, _ in self._served if i.kind == kind)
        raise Conflict(f"this server holds no {label} drafter with LSA weights {fingerprint} and TLI={tli} "
                       f"(it serves: {held or f'no {label} drafter'}); start the server with your drafter (--drafter)")

    @staticmethod
    def _accept(session: BackendSession, tree: DraftTree, logits: Tensor | None,
                choices: list[int] | None = None) -> tuple[list[int], int]:
        """The tree's accepted path and next token: greedily from the target's argmax per node
        (`choices`, or logits [N, V]), or sampled losslessly from logits [N, V]."""
        if session.sampling is None:
            return greedy_accept_choices(tree, choices if choices is not None else logits.argmax(-1).tolist())
        return sampled_accept(tree, session.sampling.probs(logits), session.generator)

    @staticmethod
    def _pick(session: BackendSession, logits: Tensor) -> int:
        """logits [1, V] -> the target's token."""
        if session.sampling is None:
            return int(logits.argmax(-1))
        return int(sample(session.sampling.probs(logits), session.generator))

    @staticmethod
    def _sync(session: BackendSession, out: TargetOutput, nodes: list[int], start: int) -> SyncPayload:
        """The client drafter's inputs for the forward's `nodes` (in order), at positions start.."""
        payload = SyncPayload(start=start, count=len(nodes))
        if nodes and session.kind.server_sync is not None:
            index = torch.tensor(nodes, device=out.keys[0].device if out.keys and out.keys[0] is not None
                                 else out.hidden_states[-1].device)
            session.kind.server_sync(payload, out, index, session.encoding, session.drafter)
        return payload


class TransformersBackend(SessionBackend):
    name = "transformers"

    def __init__(self, target: TargetModel, drafters: dict[str, Drafter] | None = None,
                 min_forward_ms: float = 0.0) -> None:
        config = getattr(target.hf_model, "config", None)
        super().__init__(target.signature, target.vocab_size, getattr(config, "max_position_embeddings", None),
                         drafters, target.device, target.dtype)
        self.target = target
        self.lock = threading.Lock()
        # benchmarks: every target forward takes at least this long, as a larger memory-bound target
        # would (its cost then barely depends on how many tokens it verifies)
        self.min_forward_s = max(0.0, min_forward_ms) / 1e3

    @classmethod
    def from_pretrained(cls, target_dir: str | Path, drafter_dirs: dict[str, str | Path] | None = None,
                        device: str = "cpu", dtype: torch.dtype = torch.float32,
                        target_name: str | None = None, min_forward_ms: float = 0.0) -> TransformersBackend:
        from vllm_moa.models import load_drafter

        target = TargetModel.from_pretrained(target_dir, dtype=dtype, device=device)
        if target_name:
            target.name = target_name
        drafters = {name: load_drafter(path, target).eval() for name, path in (drafter_dirs or {}).items()}
        return cls(target, drafters, min_forward_ms)

    @property
    def signature(self) -> TargetSignature:
        return self.target.signature  # follows a renamed target

    def _open_round(self, session: BackendSession, request: OpenRequest) -> tuple[int, SyncPayload]:
        n = len(request.prompt)
        session.cache = SlotKVCache(self.target.num_layers, [0])
        tree = DraftTree.chain(request.prompt[0], request.prompt[1:], self.device, fed=0)
        with self.lock, torch.no_grad():
            out = self._forward(session.cache, tree)
            session.cache.commit(0, list(range(n)))
            first = request.pending if request.pending is not None else self._pick(session, out.logits[0, n - 1 : n])
            sync = self._sync(session, out, list(range(request.sync_from, n)), request.sync_from)
        return first, sync

    def _verify_round(self, session: BackendSession, seq: int, tree: DraftTree) -> tuple[list[int], int, SyncPayload]:
        if session.cache is None:
            raise SessionClosed("the session was closed (by its client or by expiry); reopen it")
        with self.lock, torch.no_grad():
            if session.cache.lengths[0] > seq:
                session.cache.rewind(0, seq)
            out = self._forward(session.cache, tree)
            path, nxt = self._accept(session, tree, out.logits[0, : tree.size])  # logits [N, V]
            session.cache.commit(0, path)
            sync = self._sync(session, out, path, seq)
        return path, nxt, sync

    def generate(self, request: GenerateRequest) -> Iterator[int]:
        """Plain decoding with the same functional target; the lock is taken per token so that
        sessions of other clients keep being served while a long generation streams."""
        self._check_generate(request)
        return self._generate(request)

    def _generate(self, request: GenerateRequest) -> Iterator[int]:
        self._count("generates")
        sampling = _sampling(request.sampling)
        generator = None
        if sampling is not None:
            generator = torch.Generator(device=self.target.device)
            generator.manual_seed(request.sampling.seed) if request.sampling.seed is not None else generator.seed()
        cache = TargetKVCache()
        ids = torch.tensor([request.prompt], device=self.target.device)
        for _ in range(request.max_tokens):
            with self.lock, torch.no_grad():
                started = time.perf_counter()
                logits = self.target(ids, cache).logits[:, -1]  # [1, V]
                self._floor(started)
                token = int(logits.argmax(-1)) if sampling is None else int(sample(sampling.probs(logits), generator))
            yield token
            if token == request.eos_token_id:
                return
            ids = torch.tensor([[token]], device=self.target.device)

    # -- pieces ---------------------------------------------------------------------------------
    def _forward(self, cache: SlotKVCache, tree: DraftTree) -> TargetOutput:
        """One target forward over the tree's nodes after the cache: logits [1, N, V], per-layer K/V."""
        device = self.target.device
        started = time.perf_counter()
        width = cache.begin_round(tree.size, device)
        ids, positions, mask = verification_inputs([tree], cache.lengths, width, device)
        out = self.target(ids, cache, positions, mask)
        self._floor(started)
        return out

    def _floor(self, started: float) -> None:
        if self.min_forward_s:
            time.sleep(max(0.0, self.min_forward_s - (time.perf_counter() - started)))


# "vllm": vllm_moa.integration.serve.vllm_backend.VLLMBackend, a layer above (the CLI passes it in)
BACKENDS: dict[str, type[SessionBackend]] = {"transformers": TransformersBackend}


def _sampling(options: SamplingOptions) -> SamplingParams | None:
    """The request's sampling parameters; None for greedy decoding."""
    sampling = SamplingParams(temperature=options.temperature, top_k=options.top_k, top_p=options.top_p)
    return None if sampling.greedy else sampling
