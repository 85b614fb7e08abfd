"""One drafting interface over every drafter: MoA, EAGLE-style, independent LM, n-gram lookup.

A `DraftSession` follows one sequence (batch 1) through speculative decoding:

    start(prompt, prefill)          the target has run over the prompt (positions 0..P-1)
    propose(pending, k, sampling, generator) -> Proposal
                                    k draft tokens following `pending` (the target's last token, at
                                    position `base`, not yet run through the target): greedy, or
                                    sampled from the drafter's warped distributions (returned too)
    accept(n, tokens, verify)       the target ran over tokens = [pending, d_1..d_k] ([1, k+1]) and
                                    kept pending + d_1..d_n; `verify` is its output there

Each session keeps only what its drafter needs, rolled forward to the verified prefix after
every round; nothing verified is recomputed except where the method requires it (EAGLE
re-feeds accepted tokens with the target's true features, as EAGLE does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from vllm_moa.decoding.sampling import SamplingParams, sample
from vllm_moa.layers import KVCache, causal_mask_after
from vllm_moa.models import Drafter, EagleDrafter, IndependentDrafter, MoADrafter
from vllm_moa.target import TargetModel, TargetOutput


@dataclass
class Proposal:
    """tokens [1, k]; probs [1, k, V] the distributions they were sampled from (None: greedy)."""

    tokens: Tensor
    probs: Tensor | None = None


class DraftSession(Protocol):
    def start(self, prompt: Tensor, prefill: TargetOutput) -> None: ...

    def propose(self, pending: Tensor, k: int, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> Proposal: ...

    def accept(self, num_accepted: int, tokens: Tensor, verify: TargetOutput) -> None: ...


class _ModelSession:
    """Shared proposal loop: `_begin()` once per round, then `_step(token) -> logits [1, V]`."""

    def _begin(self) -> None:
        pass

    def _step(self, token: Tensor) -> Tensor:
        raise NotImplementedError

    def propose(self, pending: Tensor, k: int, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> Proposal:
        self._begin()
        tokens, probs, token = [], [], pending
        for _ in range(k):
            logits = self._step(token)
            if sampling is None or sampling.greedy:
                token = logits.argmax(-1, keepdim=True)
            else:
                q = sampling.probs(logits)
                token = sample(q, generator)
                probs.append(q)
            tokens.append(token)
        return Proposal(torch.cat(tokens, dim=1), torch.stack(probs, dim=1) if probs else None)


class MoASession(_ModelSession):
    """CA rows of verified tokens + SA KV cache (+ TLI caches), cropped on rollback."""

    def __init__(self, drafter: MoADrafter, target: TargetModel) -> None:
        self.drafter, self.target = drafter, target
        self.state = drafter.new_state()

    def start(self, prompt: Tensor, prefill: TargetOutput) -> None:
        self.drafter.extend_verified(self.state, prefill.keys, prefill.values)
        self.drafter.feed(self.state, prompt, self.target)

    def _step(self, token: Tensor) -> Tensor:
        return self.drafter.draft_step(self.state, token, self.target)[:, -1]

    def accept(self, num_accepted: int, tokens: Tensor, verify: TargetOutput) -> None:
        keep = self.state.num_verified + num_accepted + 1  # + pending and the accepted drafts
        self.drafter.rollback(self.state, keep)
        self.drafter.extend_verified(self.state, [k[:, :, : num_accepted + 1] for k in verify.keys],
                                     [v[:, :, : num_accepted + 1] for v in verify.values])
        if self.state.sa_length < keep:  # all drafts accepted: the last one was never fed
            self.drafter.feed(self.state, tokens[:, -1:], self.target)


class EagleSession(_ModelSession):
    """One decoder layer's KV cache over (token, previous feature) inputs; past the last verified
    token the drafter feeds on its own predicted features."""

    def __init__(self, drafter: EagleDrafter, target: TargetModel) -> None:
        self.drafter, self.target = drafter, target
        self.cache = KVCache()
        self.last_feature: Tensor | None = None  # target's final hidden at the last verified position

    def _run(self, tokens: Tensor, features_in: Tensor) -> Tensor:
        """tokens [1, n], features_in [1, n, E] at the next cache positions -> predicted features."""
        b, n = tokens.shape
        start = self.cache.length
        positions = torch.arange(start, start + n, device=tokens.device).expand(b, n)
        hidden = self.drafter.fc(torch.cat([self.target.embed(tokens), features_in], dim=-1))
        return self.drafter.layer(hidden, positions, causal_mask_after(start, n, tokens.device), self.cache)

    def _feed_verified(self, tokens: Tensor, true_features: Tensor) -> None:
        """Verified tokens [1, n] with the target's features [1, n, E] at the same positions."""
        previous = torch.cat([self.last_feature, true_features[:, :-1]], dim=1)
        self._run(tokens, previous)
        self.last_feature = true_features[:, -1:]

    def start(self, prompt: Tensor, prefill: TargetOutput) -> None:
        self.last_feature = torch.zeros_like(prefill.hidden_states[-1][:, :1])
        self._feed_verified(prompt, prefill.hidden_states[-1])

    def _begin(self) -> None:
        self.base = self.cache.length
        self.feature = self.last_feature

    def _step(self, token: Tensor) -> Tensor:
        self.feature = self._run(token, self.feature)  # feature autoregression
        return self.target.lm_head(self.feature)[:, -1]

    def accept(self, num_accepted: int, tokens: Tensor, verify: TargetOutput) -> None:
        self.cache.crop(self.base)
        self._feed_verified(tokens[:, : num_accepted + 1], verify.hidden_states[-1][:, : num_accepted + 1])


class IndependentSession(_ModelSession):
    """A small LM with its own KV caches, cropped on rollback."""

    def __init__(self, drafter: IndependentDrafter) -> None:
        self.drafter = drafter
        self.caches = [KVCache() for _ in drafter.layers]

    def start(self, prompt: Tensor, prefill: TargetOutput) -> None:
        self.drafter(prompt, self.caches)

    def _begin(self) -> None:
        self.base = self.caches[0].length

    def _step(self, token: Tensor) -> Tensor:
        return self.drafter(token, self.caches)[:, -1]

    def accept(self, num_accepted: int, tokens: Tensor, verify: TargetOutput) -> None:
        keep = self.base + num_accepted + 1
        for cache in self.caches:
            cache.crop(keep)
        if self.caches[0].length < keep:  # all drafts accepted: the last one was never fed
            self.drafter(tokens[:, -1:], self.caches)


class NgramSession:
    """Prompt lookup: propose what followed the longest earlier match of the recent suffix."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, vocab_size: int | None = None) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.vocab_size = max_ngram, min_ngram, vocab_size
        self.history: list[int] = []

    def start(self, prompt: Tensor, prefill: TargetOutput) -> None:
        self.history = prompt[0].tolist()

    def propose(self, pending: Tensor, k: int, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> Proposal:
        """Deterministic proposals: when sampling, q is a point mass on each proposed token."""
        tokens = self.history + [int(pending)]
        proposal: list[int] = []
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # most recent earlier match first
                if tokens[start : start + n] == suffix:
                    proposal = tokens[start + n : start + n + k]
                    break
            if proposal:
                break
        proposal = (proposal + [int(pending)] * k)[:k]  # pad: a wrong guess costs nothing extra
        drafts = torch.tensor([proposal], device=pending.device)
        if sampling is None or sampling.greedy:
            return Proposal(drafts)
        if self.vocab_size is None:
            raise ValueError("n-gram sampling needs the vocabulary size")
        return Proposal(drafts, torch.nn.functional.one_hot(drafts, self.vocab_size).float())

    def accept(self, num_accepted: int, tokens: Tensor, verify: TargetOutput) -> None:
        self.history += tokens[0, : num_accepted + 1].tolist()


def open_session(drafter: Drafter | str, target: TargetModel) -> DraftSession:
    """A drafting session for `drafter` (a loaded drafter, or "ngram")."""
    if drafter == "ngram":
        return NgramSession(vocab_size=target.vocab_size)
    if isinstance(drafter, MoADrafter):
        return MoASession(drafter, target)
    if isinstance(drafter, EagleDrafter):
        return EagleSession(drafter, target)
    if isinstance(drafter, IndependentDrafter):
        return IndependentSession(drafter)
    raise TypeError(f"no drafting session for {type(drafter).__name__}")
