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
exponential forgetting and a weak prior.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Linear:
    """y ~ a + b * x by exponentially weighted least squares (falls back to the mean)."""

    decay: float
    proportional: bool = False  # with one x seen so far: y ~ x (else y constant)
    sw: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.sw, self.sx, self.sy = d * self.sw + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def predict(self, x: float, default: float) -> float:
        if self.sw == 0:
            return default
        mean_x, mean_y = self.sx / self.sw, self.sy / self.sw
        var = self.sxx / self.sw - mean_x * mean_x
        if var <= 1e-9:  # one x seen so far
            return mean_y * x / mean_x if self.proportional and mean_x > 0 else mean_y
        slope = max(0.0, (self.sxy / self.sw - mean_x * mean_y) / var)
        return max(0.0, mean_y + slope * (x - mean_x))


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
        self.successes, self.trials = prior_rate * prior_weight, prior_weight
        self.net_s: float | None = None
        self.server = _Linear(decay)  # a forward over a few dozen nodes costs about what one costs
        self.draft = _Linear(decay, proportional=True)  # one drafter step per level

    @property
    def rate(self) -> float:
        """Estimated per-level acceptance probability."""
        return min(0.99, max(0.01, self.successes / self.trials))

    def observe_acceptance(self, depth: int, accepted: int) -> None:
        if depth <= 0:
            return
        d = self.decay
        self.successes = d * self.successes + accepted
        self.trials = d * self.trials + accepted + (1 if accepted < depth else 0)

    def observe_timing(self, depth: int, wall_s: float, server_s: float, draft_s: float | None) -> None:
        net = max(0.0, wall_s - server_s)
        self.net_s = net if self.net_s is None else self.decay * self.net_s + (1 - self.decay) * net
        self.server.add(self.nodes(depth) + 1, server_s)
        if draft_s is not None and depth > 0:
            self.draft.add(depth, draft_s)

    def expected_tokens(self, depth: int) -> float:
        a = self.rate
        return (1 - a ** (depth + 1)) / (1 - a)

    def round_time(self, depth: int) -> float:
        net = self.net_s if self.net_s is not None else 0.05
        return net + self.server.predict(self.nodes(depth) + 1, 0.01) + self.draft.predict(depth, 0.005 * depth)

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
