"""The client's drafter: the runtime's drafting sessions (decoding/drafters.py), fed by server
payloads instead of a local target forward, plus what a client needs beyond the runtime:

    start(prompt, sync)         the server prefilled the prompt; `sync` is the drafter's view of it
    propose(pending, spec)      a chain or tree from the verified state (the runtime's proposal loop)
    accept(tree, path, sync)    the server kept `path`; `sync` covers the path's tokens
    rollback()                  forget everything past the verified tokens
    draft_ahead(chain, n)       offline: extend an unverified chain [pending, t1, t2, ...] by n
                                tokens with the drafter alone (MoA TLI = 0 is a complete LM given its
                                rows; EAGLE runs on its own predicted features; independent and
                                n-gram need nothing from the target)

What each drafter takes from `sync` (protocol.SyncPayload): MoA the Ekv2E rows (+ the target's
last-TLI-layer K/V) through `MoADrafter.extend_rows`; EAGLE the target's final hidden states;
independent and n-gram nothing. The client still needs the target's embedding and LM head (and
its last TLI layers for MoA TLI > 0): `target` here is a local `TargetModel`; its other layers are
never run on the client.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_moa import registry as kinds
from vllm_moa.config import TargetSignature
from vllm_moa.decoding.drafters import EagleSession, IndependentSession, MoASession, NgramSession
from vllm_moa.decoding.sampling import SamplingParams, sample
from vllm_moa.decoding.tree import DraftSpec, DraftTree
from vllm_moa.models import EagleDrafter, IndependentDrafter, MoADrafter
from vllm_moa.registry import DrafterArg
from vllm_moa.serving.payload import PayloadError, decode
from vllm_moa.serving.protocol import DrafterDecl, SyncPayload
from vllm_moa.target import TargetModel


@dataclass
class SyncTensors:
    """A decoded SyncPayload: rows / hidden [1, n, E]; tli_keys / tli_values: TLI x [1, H_kv, n, d]."""

    start: int
    count: int
    rows: Tensor | None = None
    tli_keys: list[Tensor] | None = None
    tli_values: list[Tensor] | None = None
    hidden: Tensor | None = None


def decode_sync(sync: SyncPayload, dtype: torch.dtype, device: torch.device,
                signature: TargetSignature | None = None) -> SyncTensors:
    """Decode and shape-check a payload (a malformed one raises PayloadError). With the target's
    `signature` the widths are checked too: rows / hidden [n, E], TLI K/V [tli, H_kv, n, d]."""
    out = SyncTensors(sync.start, sync.count)
    for name in ("rows", "hidden"):
        enc = getattr(sync, name)
        if enc is not None:
            t = decode(enc, dtype, device)
            if t.dim() != 2 or t.shape[0] != sync.count or (signature and t.shape[1] != signature.hidden_size):
                width = f" (the target's width is {signature.hidden_size})" if signature else ""
                raise PayloadError(f"sync {name} has shape {list(t.shape)} for {sync.count} tokens{width}")
            setattr(out, name, t[None])
    if (sync.tli_keys is None) != (sync.tli_values is None):
        raise PayloadError("sync has TLI keys without values (or values without keys)")
    if sync.tli_keys is not None:
        k, v = decode(sync.tli_keys, dtype, device), decode(sync.tli_values, dtype, device)
        if k.dim() != 4 or k.shape != v.shape or k.shape[2] != sync.count or (
                signature and (k.shape[1], k.shape[3]) != (signature.num_kv_heads, signature.head_dim)):
            raise PayloadError(f"sync TLI K/V have shapes {list(k.shape)}, {list(v.shape)} for {sync.count} tokens")
        out.tli_keys = [x[None] for x in k.unbind(0)]
        out.tli_values = [x[None] for x in v.unbind(0)]
    return out


class _Local:
    """Shared offline drafting: `_chain_logits(tokens)` feeds tokens after what is fed so far and
    returns the next-token logits [V] after the last of them."""

    kind: str
    device: torch.device

    def _init_local(self) -> None:
        self.fed: list[int] = []  # the unverified chain [pending, t1, ...] fed so far past the verified tokens
        self.verified = 0  # tokens the drafter holds as target-verified

    def begin(self) -> None:
        """Before a chain built by the client (a resync) is verified: the state is the verified prefix."""
        self.rollback()
        self._begin()

    def draft_ahead(self, chain: list[int], n: int, sampling: SamplingParams | None = None,
                    generator: torch.Generator | None = None, stop_token: int | None = None) -> list[int]:
        """Extend the unverified chain by up to n tokens (greedy, or sampled from the drafter)."""
        if self.fed != chain[: len(self.fed)]:
            self.rollback()
        logits = self._chain_logits(chain[len(self.fed):])
        self.fed = list(chain)
        out: list[int] = []
        while True:
            if sampling is None or sampling.greedy:
                token = int(logits.argmax())
            else:
                token = int(sample(sampling.probs(logits[None]), generator))
            out.append(token)
            if len(out) >= n or token == stop_token:
                return out
            logits = self._chain_logits([token])
            self.fed.append(token)

    def _chain_logits(self, tokens: list[int]) -> Tensor:
        raise NotImplementedError

    def _begin(self) -> None:
        raise NotImplementedError

    def rollback(self) -> None:
        raise NotImplementedError


class LocalMoA(MoASession, _Local):
    kind = "moa"

    def __init__(self, drafter: MoADrafter, target: TargetModel) -> None:
        super().__init__(drafter, target)
        self._init_local()
        self.fingerprint = drafter.lsa_fingerprint()

    def declaration(self) -> DrafterDecl:
        return DrafterDecl(kind="moa", target=self.drafter.config.target_signature.to_dict(),
                           lsa_fingerprint=self.fingerprint, tli=self.drafter.tli)

    def _check(self, sync: SyncTensors) -> None:
        if sync.rows is None or (self.drafter.tli > 0 and sync.tli_keys is None):
            raise PayloadError("the server sent no MoA rows (or no TLI K/V) for verified tokens")
        if len(sync.tli_keys or []) != self.drafter.tli:
            raise PayloadError(f"the server sent K/V of {len(sync.tli_keys or [])} target layers; the drafter runs "
                               f"the last {self.drafter.tli}")

    def _extend(self, sync: SyncTensors) -> None:
        if sync.count == 0:
            return
        self._check(sync)
        self.drafter.extend_rows(self.state, sync.rows, sync.tli_keys or [], sync.tli_values or [])
        self.verified = self.state.num_verified

    def start(self, prompt: list[int], sync: SyncTensors) -> None:
        self._extend(sync)
        self.drafter.feed(self.state, torch.tensor([prompt], device=self.device), self.target)

    def accept(self, tree: DraftTree, path: list[int], sync: SyncTensors) -> None:
        self._check(sync)
        self.accept_rows(tree, path, sync.rows, sync.tli_keys or [], sync.tli_values or [])
        self.verified = self.state.num_verified
        self.fed = []

    def rollback(self) -> None:
        self.drafter.rollback(self.state, self.state.num_verified)
        self.fed = []

    def _chain_logits(self, tokens: list[int]) -> Tensor:
        ids = torch.tensor([tokens], device=self.device)
        return self.drafter.draft_step(self.state, ids, self.target)[0, -1]  # chain at the next SA positions


class LocalEagle(EagleSession, _Local):
    kind = "eagle"

    def __init__(self, drafter: EagleDrafter, target: TargetModel) -> None:
        super().__init__(drafter, target)
        self._init_local()
        self._predicted: Tensor | None = None  # feature predicted at the last fed chain token

    def declaration(self) -> DrafterDecl:
        return DrafterDecl(kind="eagle", target=self.drafter.config.target_signature.to_dict())

    def _hidden(self, sync: SyncTensors) -> Tensor:
        if sync.hidden is None:
            raise PayloadError("the server sent no hidden states for verified tokens")
        return sync.hidden

    def start(self, prompt: list[int], sync: SyncTensors) -> None:
        hidden = self._hidden(sync)
        self.last_feature = torch.zeros_like(hidden[:, :1])
        self._feed_verified(torch.tensor([prompt], device=self.device), hidden)
        self.verified = self.cache.length

    def accept(self, tree: DraftTree, path: list[int], sync: SyncTensors) -> None:
        self.cache.crop(self.base)
        self._feed_verified(tree.tokens[path][None].to(self.device), self._hidden(sync))
        self.verified = self.cache.length
        self.fed = []

    def rollback(self) -> None:
        self.cache.crop(self.verified)
        self.fed = []

    def _chain_logits(self, tokens: list[int]) -> Tensor:
        for token in tokens:  # feature-autoregressive: one token at a time
            feature_in = self.last_feature if self.cache.length == self.verified else self._predicted
            self._predicted = self._run(torch.tensor([[token]], device=self.device), feature_in)  # [1, 1, E]
        return self.drafter.draft_logits(self._predicted, self.target)[0, -1]


class LocalIndependent(IndependentSession, _Local):
    kind = "independent"

    def __init__(self, drafter: IndependentDrafter) -> None:
        super().__init__(drafter)
        self._init_local()

    def declaration(self) -> DrafterDecl:
        return DrafterDecl(kind="independent", target=self.drafter.config.target_signature.to_dict())

    def start(self, prompt: list[int], sync: SyncTensors) -> None:
        self.drafter(torch.tensor([prompt], device=self.device), self.caches)
        self.verified = self.caches[0].length

    def accept(self, tree: DraftTree, path: list[int], sync: SyncTensors) -> None:
        super().accept(tree, path, None)  # needs nothing from the target
        self.verified = self.caches[0].length
        self.fed = []

    def rollback(self) -> None:
        for cache in self.caches:
            cache.crop(self.verified)
        self.fed = []

    def _chain_logits(self, tokens: list[int]) -> Tensor:
        return self.drafter(torch.tensor([tokens], device=self.device), self.caches)[0, -1]


class LocalNgram(NgramSession, _Local):
    kind = "ngram"
    device = torch.device("cpu")

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        super().__init__(max_ngram, min_ngram)
        self._init_local()

    def declaration(self) -> DrafterDecl:
        return DrafterDecl(kind="ngram")

    def start(self, prompt: list[int], sync: SyncTensors) -> None:
        self.history = list(prompt)

    def accept(self, tree: DraftTree, path: list[int], sync: SyncTensors) -> None:
        super().accept(tree, path, None)

    def _begin(self) -> None:
        pass

    def rollback(self) -> None:
        self.fed = []

    def draft_ahead(self, chain: list[int], n: int, sampling: SamplingParams | None = None,
                    generator: torch.Generator | None = None, stop_token: int | None = None) -> list[int]:
        """What followed the latest match of the chain's suffix (nothing when there is none)."""
        history = self.history
        self.history = history + chain[:-1]
        try:
            found = self.continuations(chain[-1], n, 1)
        finally:
            self.history = history
        out = found[0] if found else []
        if stop_token is not None and stop_token in out:
            out = out[: out.index(stop_token) + 1]
        return out


LocalSession = LocalMoA | LocalEagle | LocalIndependent | LocalNgram


def open_local(drafter: DrafterArg, target: TargetModel | None) -> LocalSession:
    """The client-side session for a drafter object of any kind that drafts on a client (a loaded
    drafter, NgramDrafter; "ngram" is accepted for the latter)."""
    drafter = kinds.as_drafter(drafter)
    kind = kinds.kind_of(drafter)
    if kind.client_session is None:
        raise ValueError(f"a {kind.name} drafter does not draft on a client")
    if kind.client_needs_target and target is None:
        raise ValueError(f"a {kind.name} drafter needs the target's embedding and LM head on the client: pass target=")
    return kind.client_session(drafter, target)


def propose(session: LocalSession, pending: int, spec: DraftSpec) -> DraftTree:
    """A fresh proposal from the verified state (deterministic: argmax chain or top-k tree; the
    server's sampled acceptance treats its nodes as point masses, which stays lossless)."""
    session.rollback()
    return session.propose(pending, spec, None, None)
