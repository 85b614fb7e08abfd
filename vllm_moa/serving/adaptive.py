"""How deep to draft when every verification costs a network round trip ("minimal calls").

A round with draft depth K costs

    t(K) = net + server(N(K)) + draft(K)

(net: measured wall time minus the server's own time, so RTT + transfer; server: its reported
compute time, linear in the verified nodes N(K) = K for a chain, fitted online; draft: the local
drafter, linear in K) and yields, if each drafted level is accepted with probability a,

    E(K) = 1 + a + ... + a^K = (1 - a^(K+1)) / (1 - a)

tokens (accepted drafts + the target's own). The controller picks the K that maximises E(K)/t(K):
on a slow link net dominates and K grows (fewer, larger verifications); on a fast link with a
costly drafter it shrinks. `a` is the maximum-likelihood rate of a geometric model over recent
rounds (a round of depth K with k accepted is k successes and, if k < K, one failure), with
exponential forgetting and a weak prior (the estimators of decoding/speed_control.py, which
makes the same choice for the runtime's own rounds, plain decoding included).
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_moa.decoding.speed_control import GeometricAcceptance, WeightedLinearFit


class DraftController:
    """Chooses the draft depth from measured timings and acceptance; `fixed` turns it off."""

    def __init__(self, max_depth: int, init_depth: int = 4, fixed: int | None = None,
                 prior_rate: float = 0.6, prior_weight: float = 4.0, decay: float = 0.9,
                 nodes: Callable[[int], int] = lambda k: k) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth, self.fixed, self.nodes = max_depth, fixed, nodes
        self.depth = min(init_depth, max_depth)
        self.decay = decay
        self.acceptance = GeometricAcceptance(prior_rate, prior_weight, decay)
        self.net_s: float | None = None
        self.server = WeightedLinearFit(decay)  # a forward over a few dozen nodes costs about what one costs
        self.draft = WeightedLinearFit(decay, proportional=True)  # one drafter step per level

    @property
    def rate(self) -> float:
        """Estimated per-level acceptance probability."""
        return self.acceptance.rate

    def observe_acceptance(self, depth: int, accepted: int) -> None:
        self.acceptance.observe(depth, accepted)

    def observe_timing(self, depth: int, wall_s: float, server_s: float, draft_s: float | None) -> None:
        net = max(0.0, wall_s - server_s)
        self.net_s = net if self.net_s is None else self.decay * self.net_s + (1 - self.decay) * net
        self.server.add(self.nodes(depth) + 1, server_s)
        if draft_s is not None and depth > 0:
            self.draft.add(depth, draft_s)

    def expected_tokens(self, depth: int) -> float:
        return self.acceptance.expected_tokens(depth)

    def flight_time(self, depth: int) -> float:
        """A round's time from its request to its verdict: the network and the server's verification."""
        net = self.net_s if self.net_s is not None else 0.05
        return net + self.server.predict(self.nodes(depth) + 1, 0.01)

    def draft_time(self, depth: int) -> float:
        return self.draft.predict(depth, 0.005 * depth)

    def round_time(self, depth: int) -> float:
        return self.flight_time(depth) + self.draft_time(depth)

    def choose(self, limit: int | None = None) -> int:
        """The depth for the next round (<= limit, e.g. the tokens still wanted)."""
        top = self.max_depth if limit is None else max(1, min(self.max_depth, limit))
        if self.fixed is not None:
            return min(self.fixed, top)
        if self.net_s is None:
            return min(self.depth, top)
        best = max(range(1, top + 1), key=lambda k: self.expected_tokens(k) / max(1e-6, self.round_time(k)))
        self.depth = best
        return best
