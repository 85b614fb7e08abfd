"""The client's drafter: the runtime's drafting sessions (each kind's session.py), fed by server
payloads instead of a local target forward, plus what a client needs beyond the runtime
(`LocalDrafting`, the base of each kind's client.py):

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
from vllm_moa.decoding.sampling import SamplingParams, sample
from vllm_moa.decoding.tree import DraftSpec, DraftTree
from vllm_moa.registry import DrafterArg
from vllm_moa.serving.payload import PayloadError, decode
from vllm_moa.serving.protocol import SyncPayload
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


class LocalDrafting:
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

    def rows_wanted_from(self, prompt_len: int) -> int:
        """The first prompt position whose sync rows the drafter will ever read (its open asks the
        server for rows from there, `OpenRequest.sync_from`): 0, all of them, unless a kind says less."""
        return 0

    def _chain_logits(self, tokens: list[int]) -> Tensor:
        raise NotImplementedError

    def _begin(self) -> None:
        raise NotImplementedError

    def rollback(self) -> None:
        raise NotImplementedError


LocalSession = LocalDrafting  # each kind's client session (vllm_moa/kinds/<kind>/client.py) is one


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
