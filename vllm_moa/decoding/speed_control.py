"""Speculation that pays or turns itself down: the draft depth of each round, 0 (plain decoding)
included, chosen from measured costs and acceptance.

A round over B sequences at depth K (a chain of K tokens, or the configured tree at its depth)
verifies N(K) + 1 tokens per sequence (N(K) = K for a chain, the tree's node budget for a tree) and
yields, if each drafted level is accepted with probability a (a geometric model),

    E(K) = 1 + a + ... + a^K = (1 - a^(K+1)) / (1 - a)      tokens per sequence

in time

    t(B, K) = verify(B * (N(K) + 1)) + draft(B * K)

verify: the target's forward over that many tokens, from a cost table (`CostTable`: an
exponentially weighted mean per token count measured, interpolated between them and extended
linearly beyond; an entry forgets only through its own newer measurements, so long runs of plain
rounds never erase what a speculative round cost); draft: the drafter, proportional to the levels
it drafts for all sequences (an exponentially weighted least-squares fit); `a` is the maximum-likelihood rate over
recent drafted tokens (a round of depth K with k accepted is k successes and, if k < K, one
failure; each round's trials, over all its sequences, fade the past by exp(-trials /
memory_trials): about the last 128 trials count, whatever the batch size) with a weak prior. A
short memory is biased near a tie: a low run of estimates turns drafting off, and plain rounds
bring no data to correct it until the next probe. After one speculative and one plain round, the controller picks the K that
maximises B * E(K) / t(B, K); K = 0 is plain
decoding: the drafter does not run at all (the engine keeps the target's outputs of those tokens
and runs the drafter over all of them in one call when it drafts again). While K = 0 is
chosen, one round in `probe_every` drafts anyway, so that acceptance and cost estimates stay
current (a batch that shrinks, a text that turns repetitive); a probe that does not change the
verdict doubles that interval (up to `max_probe_every`). A probe also waits until the plain
rounds since the last one took `1 / probe_budget` times what that probe cost beyond a plain round
(its drafter's catch-up over the tokens it missed, and the round's extra time): probing costs at
most about `probe_budget` of the time, however near the verdict is to a tie.

`FasterShape` is the model-free counterpart for engines that time whole rounds only (vLLM's
proposer, integration/moa/tree_or_chain.py): of a few draft shapes, the one whose rounds measured more
tokens per second at the batch size, the others re-tried now and then.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class WeightedLinearFit:
    """y ~ c + s * x by exponentially weighted least squares (the mean while one x was seen)."""

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

    @property
    def seen(self) -> bool:
        return self.sw > 0

    @property
    def spread(self) -> bool:
        """More than one x seen (a slope can be fitted)."""
        return self.sw > 0 and self.sxx / self.sw - (self.sx / self.sw) ** 2 > 1e-9

    def predict(self, x: float, default: float) -> float:
        if self.sw == 0:
            return default
        mean_x, mean_y = self.sx / self.sw, self.sy / self.sw
        var = self.sxx / self.sw - mean_x * mean_x
        if var <= 1e-9:  # one x seen so far
            return mean_y * x / mean_x if self.proportional and mean_x > 0 else mean_y
        slope = max(0.0, (self.sxy / self.sw - mean_x * mean_y) / var)
        return max(0.0, mean_y + slope * (x - mean_x))


@dataclass
class CostTable:
    """Measured cost per size x (a token count): an exponentially weighted mean for each x seen,
    linear interpolation between them, the line through the two nearest beyond them (slope >= 0)."""

    decay: float
    entries: dict[float, tuple[float, float]] = field(default_factory=dict)  # x -> (weighted sum of y, weight)

    def add(self, x: float, y: float) -> None:
        total, weight = self.entries.get(x, (0.0, 0.0))
        self.entries[x] = (self.decay * total + y, self.decay * weight + 1)

    @property
    def seen(self) -> bool:
        return bool(self.entries)

    @property
    def spread(self) -> bool:
        """More than one size measured (costs can be compared across sizes)."""
        return len(self.entries) > 1

    def predict(self, x: float, default: float) -> float:
        if not self.entries:
            return default
        points = sorted((size, total / weight) for size, (total, weight) in self.entries.items())
        if len(points) == 1:
            return points[0][1]
        below = [p for p in points if p[0] <= x]
        above = [p for p in points if p[0] >= x]
        if below and above:
            (x0, y0), (x1, y1) = below[-1], above[0]
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = points[:2] if not below else points[-2:]
        slope = max(0.0, (y1 - y0) / (x1 - x0))
        return max(0.0, y1 + slope * (x - x1) if below else y0 + slope * (x - x0))


class GeometricAcceptance:
    """The per-level acceptance rate a of drafted tokens, with exponential forgetting and a prior:
    by `decay` per round, or (`memory_trials`) by exp(-n / memory_trials) for a round of n trials,
    so that a batch's round of many sequences weighs as much as as many rounds of one."""

    def __init__(self, prior_rate: float = 0.6, prior_weight: float = 4.0, decay: float = 0.9,
                 memory_trials: float | None = None) -> None:
        self.decay, self.memory_trials = decay, memory_trials
        self.successes, self.trials = prior_rate * prior_weight, prior_weight

    @property
    def rate(self) -> float:
        return min(0.99, max(0.01, self.successes / self.trials))

    def observe(self, depth: int, accepted: int | list[int]) -> None:
        """One round's accepted drafts: of one sequence, or of each sequence of a batch (forgetting
        applies once per round, so a batch's round is not forgotten within itself)."""
        if depth <= 0:
            return
        counts = [accepted] if isinstance(accepted, int) else accepted
        trials = sum(k + (1 if k < depth else 0) for k in counts)
        d = self.decay if self.memory_trials is None else math.exp(-trials / self.memory_trials)
        self.successes = d * self.successes + sum(counts)
        self.trials = d * self.trials + trials

    def expected_tokens(self, depth: int) -> float:
        """E(depth): accepted drafts + the target's own token, per sequence and round."""
        a = self.rate
        return (1 - a ** (depth + 1)) / (1 - a)


class SpeedController:
    """Chooses each round's draft depth among `depths` (0 = plain decoding) for a batch of B
    sequences; `nodes(K)` is the drafted nodes per sequence at depth K."""

    def __init__(self, depths: list[int], nodes: Callable[[int], int], probe_every: int = 16,
                 max_probe_every: int = 128, decay: float = 0.8, probe_budget: float = 0.02,
                 memory_trials: float = 128.0) -> None:
        if not depths or min(depths) < 1:
            raise ValueError(f"speculative depths must be >= 1, got {depths}")
        self.depths, self.nodes = sorted(set(depths)), nodes
        self.probe_every, self.min_probe_every, self.max_probe_every = probe_every, probe_every, max_probe_every
        self.probing = False  # the last speculative round was a probe
        self.acceptance = GeometricAcceptance(memory_trials=memory_trials)
        self.verify = CostTable(decay)
        self.draft = WeightedLinearFit(decay, proportional=True)
        self.plain_streak = 0
        self.probe_budget = probe_budget
        self.plain_seconds = 0.0  # plain rounds' time since the last probe
        self.probe_cost = 0.0  # what the last probe cost beyond a plain round
        self.measuring_probe = False  # the round chosen last is a probe: observe() prices it
        self.last_speculative = self.depths[-1]
        self.chosen: dict[int, int] = {}  # depth -> rounds (what it did, for reports)

    def round_time(self, batch: int, depth: int) -> float:
        tokens = batch * (self.nodes(depth) + 1 if depth else 1)
        return self.verify.predict(tokens, 0.01 * tokens) + (self.draft.predict(batch * depth, 0.0) if depth else 0.0)

    def tokens_per_second(self, batch: int, depth: int) -> float:
        per_sequence = self.acceptance.expected_tokens(depth) if depth else 1.0
        return batch * per_sequence / max(1e-9, self.round_time(batch, depth))

    def best_depth(self, batch: int) -> int:
        """The depth that maximises the estimated tokens per second at `batch` sequences."""
        return max([0, *self.depths], key=lambda k: self.tokens_per_second(batch, k))

    def prefers_plain(self, batch: int) -> bool:
        """Whether, on what was measured so far, plain rounds pay best at `batch` sequences (no
        side effects): an engine then starts drafting sessions only when drafting resumes."""
        return self.draft.seen and self.verify.spread and self.best_depth(batch) == 0

    def choose(self, batch: int) -> int:
        """The depth of the next round over `batch` sequences."""
        if not self.draft.seen:  # nothing measured yet: draft, and measure
            depth = self.last_speculative
        elif not self.verify.spread:  # a plain round's cost too, before comparing
            depth = 0
        else:
            depth = self.best_depth(batch)
            if depth == 0:
                if self.probing:  # the probe did not change the verdict: probe half as often
                    self.probe_every = min(self.max_probe_every, 2 * self.probe_every)
                self.probing = False
                self.plain_streak += 1
                if self.plain_streak >= self.probe_every and self.plain_seconds * self.probe_budget >= self.probe_cost:
                    depth, self.probing, self.measuring_probe = self.last_speculative, True, True
            elif not self.probing:  # speculation pays on its own estimate
                self.probe_every = self.min_probe_every
        if depth:
            self.plain_streak = 0
            self.last_speculative = depth
        self.chosen[depth] = self.chosen.get(depth, 0) + 1
        return depth

    def observe(self, batch: int, depth: int, verify_s: float, draft_s: float, accepted: list[int],
                catch_up_s: float = 0.0) -> None:
        """A round's measurements: its target forward and drafting times, each sequence's accepted
        drafts, and the drafter's catch-up before it (over tokens of plain rounds)."""
        if depth == 0:
            self.plain_seconds += verify_s
        elif self.measuring_probe:
            self.probe_cost = catch_up_s + max(0.0, verify_s + draft_s - self.round_time(batch, 0))
            self.plain_seconds, self.measuring_probe = 0.0, False
        self.verify.add(batch * (self.nodes(depth) + 1 if depth else 1), verify_s)
        if depth:
            self.draft.add(batch * depth, draft_s)
            self.acceptance.observe(depth, accepted)


class FasterShape:
    """Of a few draft shapes (say a tree and the chain of its node budget), the one whose rounds
    measure more tokens per second, per batch size: model-free, for engines that can time whole
    rounds but not their parts (vLLM's proposer sees one step begin after another).

    At each batch size every shape is first measured over `warmup` rounds; after that the best
    measured shape is chosen, and every `probe_every`-th round the best of the others instead, so
    that an estimate does not go stale (a text that changes, a batch that grows). A probe that
    leaves the verdict as it was doubles that interval (up to `max_probe_every`); a verdict that
    changes resets it. Until a batch size is measured, the verdict of the nearest measured one
    within a factor of 2 is borrowed, and every `probe_every`-th round there the shape least
    measured at it is tried (a batch shrinking as requests finish passes through many sizes, and
    rounds whose batch changed cannot be priced); with none that near, the shapes take turns. An estimate is
    tokens / seconds over the shape's rounds at that batch size, the older ones fading by
    exp(-1 / memory_rounds) per newer round of the same shape."""

    def __init__(self, shapes: list[str], warmup: int = 2, probe_every: int = 16, max_probe_every: int = 128,
                 memory_rounds: float = 32.0) -> None:
        if len(shapes) < 2 or len(set(shapes)) != len(shapes):
            raise ValueError(f"FasterShape chooses among two or more distinct shapes, got {shapes}")
        self.shapes, self.warmup = list(shapes), warmup
        self.min_probe_every, self.max_probe_every = probe_every, max_probe_every
        self.fade = math.exp(-1.0 / memory_rounds)
        self.sums: dict[tuple[int, str], list[float]] = {}  # (batch, shape) -> [rounds, tokens, seconds]
        self.tries: dict[tuple[int, str], int] = {}  # (batch, shape) -> rounds chosen, priced or not
        self.since_probe: dict[int, int] = {}
        self.probe_every: dict[int, int] = {}
        self.verdict: dict[int, str] = {}  # batch -> the best shape when last chosen

    def rate(self, batch: int, shape: str) -> float | None:
        """Measured tokens per second of `shape` at `batch` sequences (None before any round)."""
        sums = self.sums.get((batch, shape))
        return None if sums is None or sums[2] <= 0 else sums[1] / sums[2]

    def measured(self, batch: int) -> bool:
        """Whether every shape has `warmup` priced rounds at `batch` sequences."""
        return all(self.sums.get((batch, s), [0])[0] >= self.warmup for s in self.shapes)

    def choose(self, batch: int) -> str:
        """The shape of the next round over `batch` sequences."""
        shape = self._choose(batch) if self.measured(batch) else self._choose_unmeasured(batch)
        self.tries[(batch, shape)] = self.tries.get((batch, shape), 0) + 1
        return shape

    def _choose_unmeasured(self, batch: int) -> str:
        short = [s for s in self.shapes if self.sums.get((batch, s), [0])[0] < self.warmup]
        least = min(short, key=lambda s: (self.tries.get((batch, s), 0), self.sums.get((batch, s), [0])[0]))
        near = [b for b, _ in self.sums if self.measured(b) and abs(math.log(b / batch)) <= math.log(2)]
        nearest = min(near, key=lambda b: (abs(math.log(b / batch)), b), default=None)
        if nearest is None:
            return least  # nothing measured within a factor of 2: the shapes take turns
        self.since_probe[batch] = self.since_probe.get(batch, 0) + 1
        if self.since_probe[batch] % self.min_probe_every == 0:
            return least
        return max(self.shapes, key=lambda s: self.rate(nearest, s) or 0.0)

    def _choose(self, batch: int) -> str:
        ranked = sorted(self.shapes, key=lambda s: -(self.rate(batch, s) or 0.0))
        every = self.probe_every.setdefault(batch, self.min_probe_every)
        if self.verdict.get(batch) not in (None, ranked[0]):
            self.probe_every[batch] = self.min_probe_every  # the verdict changed: watch closely again
        elif self.since_probe.get(batch, 0) >= every:
            self.since_probe[batch] = 0
            self.probe_every[batch] = min(self.max_probe_every, 2 * every)
            self.verdict[batch] = ranked[0]
            return ranked[1]
        self.verdict[batch] = ranked[0]
        self.since_probe[batch] = self.since_probe.get(batch, 0) + 1
        return ranked[0]

    def observe(self, batch: int, shape: str, tokens: float, seconds: float) -> None:
        """One round of `shape` over `batch` sequences: the tokens it gave and its wall time."""
        if seconds <= 0 or shape not in self.shapes:
            return
        sums = self.sums.setdefault((batch, shape), [0.0, 0.0, 0.0])
        sums[0] += 1
        sums[1] = sums[1] * self.fade + tokens
        sums[2] = sums[2] * self.fade + seconds
