"""Speculation that turns itself down inside vLLM: the chain's K per batch size, 0 included,
chosen from the tokens per second the engine measures, so that no user writes a schedule.

vLLM's scheduler looks K up per step in a dense table indexed by the batch size
(`Scheduler.dynamic_sd_lookup`, built from `num_speculative_tokens_per_batch_size`). For a "moa"
config with `moa_adaptive` (on by default, chains and trees: moa_defaults.py) that table is replaced by
`AdaptiveK`, which answers the same lookup from measurements:

* each step over B requests that only decode is priced: the tokens it produced (every request's
  accepted drafts and the target's own token) over its wall time (from the previous step's end:
  the engine loop's schedule, forward, drafting and bookkeeping);
* a K is kept for `hold` steps at a batch size, and only steps that verify the drafts of the K
  they draft are priced (a step verifies the previous step's drafts and drafts its own);
* per batch size B, a step's time: K = 0 steps on their own, drafting steps fitted as c + s * K
  (decoding.speed_control's WeightedLinearFit; K = max_k and K = 0 are priced first, so a K in
  between costs as much as K = max_k until it is priced itself); what a step
  yields is B * E(K) tokens, E(K) = 1 + a + ... + a^K from one per-level acceptance rate `a`
  measured over every drafted position at any batch size (GeometricAcceptance, as the
  runtime's speed control); the K of most B * E(K) / (c + s * K) tokens per second is chosen
  (a move between drafting and K = 0 only for an estimate `switch_margin` ahead: near a tie the
  verdict holds, as a step's time wanders by several percent), and the end (max_k or 0) that
  was not chosen is re-tried now and then;
* a batch size not yet priced at both ends starts from what is known (`_borrowed_fit`):
  - the nearest batch size priced at both ends, if it is within a factor of 2 above (its fit as
    it is: more requests make drafting pay less, not more), or below: then this size's own K = 0
    steps are priced first and the smaller size's cost of drafting is scaled up by the ratio of
    the batch sizes (verifying and drafting grow with the rows, a step's fixed cost does not),
    so that a load that grows is not priced at max_k where it cannot pay; above `cold_batch`
    requests such a borrowed fit only prices the first probe, and K stays 0 until this size's own
    prices say drafting pays (switching it on makes the drafter catch up over every request);
  - with nothing priced near it, up to `cold_batch` requests price K = max_k first (drafting pays
    most and costs least to learn there; also where a smaller size settled on K = 0: K = 0), and
    more than that K = 0 first, then K = 0 with max_k left to the budgeted probes below: a fresh
    engine's first large batch (`vllm bench throughput`'s) costs no more than no speculation;
* a drafting probe while K = 0 pays waits until the K = 0 time since the last one is
  1 / probe_budget times what that one cost; before any was priced at a batch size its cost is
  guessed as `hold` drafting steps plus the drafter's catch-up over every token of the batch's
  requests, at what a token of a prefill cost the target (steps with several tokens per request).

A tree engine (moa_tree, node budget max_k) chooses on a ladder instead of every K: the whole
tree (K = max_k), a chain of K <= `tree_chain_k` (moa_defaults.tree_chain_k: the best path of the
tree, drafted and verified as a chain, without the tree's mask or its other nodes), or K = 0. Its
three ends are priced first; the tree's step is priced apart from the chains' line (StepCost.tree)
and its tokens per step as measured (a tree is not a chain of max_k levels), the chains' from the
acceptance rate of chains. The probes visit the two rungs not chosen in turn. So on a machine
where the tree's step costs more than its extra tokens (vLLM's CPU engine) a tree engine drafts
the chain that pays, and none where none does.

moa_defaults writes vLLM's own schedule to match for the steps before this table takes over
(the first: max_k up to `COLD_BATCH` requests, 0 above).

K = 0 steps schedule no drafts; the MoA proposer then skips its drafter and catches up when
drafting resumes (integration/moa/catch_up.py), as with vLLM's own schedule.

`SchedulerUpdatePatch` installs the table on the scheduler's first update and feeds it every
step. The scheduler lives in the engine core process; nothing crosses processes.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_moa.decoding.speed_control import GeometricAcceptance, WeightedLinearFit
from vllm_moa.integration.shell.draft_config import requested_tree
from vllm_moa.integration.shell.moa_defaults import COLD_BATCH, requested_adaptive, tree_chain_k
from vllm_moa.integration.shell.patching import VllmPatch


@dataclass
class StepCost:
    """A batch size's step time: K = 0 steps (no drafter, nothing to verify) apart from drafting
    ones, which also pay a cost of drafting at all (the drafter's call, the rejection sampler), so
    that a line through K = 0 and K = max_k would promise small K too cheaply. Drafting steps are
    fitted as c + s * K over the K priced (one K priced: the same time for every K >= 1). For a
    tree engine the whole tree (K = `tree_k`) is priced on its own: its step pays the tree mask
    and its drafting every level's nodes, which no line through the chains' K predicts."""

    plain: WeightedLinearFit
    drafting: WeightedLinearFit
    tree: WeightedLinearFit | None = None
    tree_k: int = 0

    def _fit(self, k: int) -> WeightedLinearFit:
        if k == 0:
            return self.plain
        return self.tree if self.tree is not None and k == self.tree_k else self.drafting

    def predict(self, k: int) -> float:
        return self._fit(k).predict(k, 1.0)

    def add(self, k: int, seconds: float) -> None:
        self._fit(k).add(k, seconds)


@dataclass
class ScaledStepCost:
    """A batch size's step time from a smaller one's fit: its own K = 0 steps, and the smaller
    size's cost of drafting (a drafting step's time beyond a K = 0 one) times `scale`, the ratio
    of the batch sizes."""

    own: StepCost
    smaller: StepCost
    scale: float

    def predict(self, k: int) -> float:
        base = self.own.predict(0)
        return base if k == 0 else base + self.scale * max(0.0, self.smaller.predict(k) - self.smaller.predict(0))


@dataclass
class Window:
    """The steps at one batch size that keep one K (`hold` of them)."""

    k: int
    probe: bool  # a K other than the verdict, to keep an estimate current
    left: int  # steps still to schedule at this K
    seconds: float = 0.0  # the time of its steps that only decoded at K
    steps: int = 0  # how many those were


class AdaptiveK:
    """Stands in for vLLM's dense batch size -> K table: K in 0..max_k by measured speed."""

    def __init__(self, max_k: int, hold: int = 3, probe_every: int = 16, max_probe_every: int = 128,
                 probe_budget: float = 0.03, decay: float = 0.95, cold_batch: int = COLD_BATCH,
                 switch_margin: float = 0.05,
                 tree_chain_k: int | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        if tree_chain_k is not None and not 1 <= tree_chain_k < max_k:
            raise ValueError(f"tree_chain_k must be in 1..{max_k - 1} (below the tree's budget), got {tree_chain_k}")
        self.max_k, self.hold, self.clock, self.decay, self.cold_batch = max_k, hold, clock, decay, cold_batch
        self.switch_margin = switch_margin  # how much faster a K on another rung must look (_best)
        # K = max_k is the whole tree and K <= tree_chain_k chains for a tree engine (the module
        # docstring's ladder); the ends are priced first, in this order
        self.tree_chain_k = tree_chain_k
        self.ends = (max_k, 0) if tree_chain_k is None else (max_k, tree_chain_k, 0)
        # an end not priced here is probed cheapest first (the chain before the tree)
        self.probe_order = self.ends if tree_chain_k is None else (tree_chain_k, max_k, 0)
        self.candidates = list(range(max_k + 1)) if tree_chain_k is None else [*range(tree_chain_k + 1), max_k]
        self.tree_yield: float | None = None  # a whole tree's tokens per request and step (EMA)
        self.probes: dict[int, int] = {}  # batch size -> drafting probes taken (a tree engine alternates)
        self.min_probe_every, self.max_probe_every, self.probe_budget = probe_every, max_probe_every, probe_budget
        # one per-level acceptance rate for every batch size (what a draft is worth does not
        # depend on how many requests run beside it); the last ~512 drafted positions count
        self.acceptance = GeometricAcceptance(memory_trials=512.0)  # of chains (not whole trees)
        self.cost: dict[int, StepCost] = {}  # batch size -> its step time by K
        self.priced: dict[int, set[int]] = {}  # batch size -> the K priced there
        self.window: dict[int, Window] = {}  # batch size -> its current window
        self.choices: dict[int, int] = {}  # batch size -> choices since its last probe
        self.probe_every: dict[int, int] = {}
        self.verdict: dict[int, int] = {}
        # drafting probes while K = 0 pays: what the last one cost beyond K = 0 steps (the
        # drafter's catch-up over the tokens it missed included), and the K = 0 time since
        self.probe_cost: dict[int, float] = {}
        self.plain_seconds: dict[int, float] = {}
        self.last_end: float | None = None  # when the previous busy step's output arrived
        self.context: dict[int, int] = {}  # batch size -> the tokens its requests held at its last step
        self.token_seconds: float | None = None  # what a token of a prefill costs (EMA)
        # request_gate.RequestGate (K by request), installed by its patch: which requests verify
        # none of the step's K drafts; None: every request verifies them
        self.gate: Any = None

    def __getitem__(self, batch: int) -> int:
        window = self.window.get(batch)
        if window is None or window.left <= 0:
            self._close(batch)
            window = self.window[batch] = Window(*self.choose(batch), left=self.hold)
        window.left -= 1
        return window.k

    def tokens_per_second(self, batch: int, k: int, fit: StepCost | ScaledStepCost) -> float:
        """A step's tokens over its time at K = k: per request from the gate's rates where it knows
        the running batch (K by request, request_gate.RequestGate.step_rate), else from one rate."""
        by_request = None if self.gate is None else self.gate.step_rate(batch, k, fit)
        return by_request if by_request is not None else batch * self.expected_tokens(k) / max(1e-9, fit.predict(k))

    def expected_tokens(self, k: int) -> float:
        """A request's tokens per step at K: a whole tree's as measured, a chain's from the
        per-level acceptance rate."""
        if self.tree_chain_k is not None and k == self.max_k and self.tree_yield is not None:
            return self.tree_yield
        return self.acceptance.expected_tokens(k)

    def new_cost(self) -> StepCost:
        fit = functools.partial(WeightedLinearFit, self.decay)
        return StepCost(fit(), fit(), None if self.tree_chain_k is None else fit(), self.max_k)

    def choose(self, batch: int) -> tuple[int, bool]:
        """(K, probe) of the next `hold` steps at `batch` requests: the ends priced first where
        nothing near is known (module docstring); then the K of most estimated tokens per second,
        and every `probe_every`-th choice the end (max_k or 0) that was not chosen or not priced
        here, the interval doubling while the verdict holds. A drafting probe while K = 0 is
        chosen also waits until the K = 0 steps since the last one took 1 / probe_budget times
        what that one cost beyond them (before one was priced here: `_first_probe_guess`)."""
        priced = self.priced.get(batch, set())
        own = set(self.ends) <= priced
        fit = self.cost[batch] if own else self._borrowed_fit(batch)
        if fit is None and batch <= self.cold_batch:
            if self._no_drafts_below(batch):  # drafting did not pay with fewer requests: nor here
                return 0, False
            return next(k for k in self.ends if k not in priced), False
        if fit is None and 0 not in priced:
            return 0, False  # many requests and nothing known: K = 0 first, what no speculation costs
        # above cold_batch only this size's own prices start drafting: a K = 0 -> K > 0 switch also
        # catches the drafter up over every request's tokens, which only a budgeted probe counts
        borrowed = not own and batch > self.cold_batch
        best = 0 if fit is None or borrowed else self._best(batch, fit)
        every = self.probe_every.setdefault(batch, self.min_probe_every)
        if self.verdict.get(batch, best) != best:
            self.probe_every[batch] = every = self.min_probe_every  # the verdict moved: watch closely again
        self.verdict[batch] = best
        self.choices[batch] = self.choices.get(batch, 0) + 1
        missing = [k for k in self.probe_order if k not in priced and k != best]
        probe = missing[0] if missing else self._next_probe(batch, best)
        affordable = probe == 0 or best != 0 or \
            self.plain_seconds.get(batch, 0.0) * self.probe_budget >= self.probe_cost.get(
                batch, self._first_probe_guess(batch, fit, probe))
        if self.choices[batch] < every or not affordable:
            return best, False
        self.choices[batch] = 0
        self.probes[batch] = self.probes.get(batch, 0) + 1
        if not missing:
            self.probe_every[batch] = min(self.max_probe_every, 2 * every)
        return probe, True

    def _best(self, batch: int, fit: StepCost | ScaledStepCost) -> int:
        """The K of most estimated tokens per second, except that the verdict leaves its rung only
        for a K estimated `switch_margin` faster than the best K on it: a step's time wanders by
        several percent on a shared machine, and a move between rungs costs (drafting that resumes
        catches the drafter up over every token it missed), so near a tie the verdict holds."""
        rate = functools.partial(self.tokens_per_second, batch, fit=fit)
        best = max(self.candidates, key=rate)
        held = self.verdict.get(batch)
        if held is None or self.rung(held) == self.rung(best):
            return best
        keep = max((k for k in self.candidates if self.rung(k) == self.rung(held)), key=rate)
        return best if rate(best) > (1 + self.switch_margin) * rate(keep) else keep

    def rung(self, k: int) -> int:
        """Which rung a K stands on: 0 (no drafts), 1 (a chain), 2 (a tree engine's whole tree)."""
        if k == 0:
            return 0
        return 2 if self.tree_chain_k is not None and k == self.max_k else 1

    def _next_probe(self, batch: int, best: int) -> int:
        """The end probed once every end is priced: the other end of a chain engine; for a tree
        engine the two ends of the ladder that were not chosen, in turn (a chain chosen: K = 0 and
        the whole tree; the tree or K = 0 chosen: the other one and tree_chain_k)."""
        if self.tree_chain_k is None:
            return 0 if best else self.max_k
        others = [k for k in self.ends if k != (self.tree_chain_k if 0 < best < self.max_k else best)]
        return others[self.probes.get(batch, 0) % len(others)]

    def _first_probe_guess(self, batch: int, fit: StepCost | ScaledStepCost | None, k: int) -> float:
        """What the first drafting probe (at K = k) at `batch` costs beyond K = 0 steps, before one
        was priced: `hold` steps at k (without a fit: each taken as two K = 0 steps), and the
        drafter's catch-up over every token the batch's requests hold, at a prefill token's cost
        (else at a K = 0 step's cost per request, which is more)."""
        plain = self.cost[batch].predict(0) if batch in self.cost else 0.0
        extra = plain if fit is None else fit.predict(k) - fit.predict(0)
        per_token = self.token_seconds if self.token_seconds is not None else plain / batch
        return self.hold * max(0.0, extra) + self.context.get(batch, 0) * per_token

    def _close(self, batch: int) -> None:
        """A window ends: a drafting probe while K = 0 was chosen is priced whole."""
        window = self.window.get(batch)
        if window is None or not window.probe or window.k == 0 or batch not in self.cost:
            return
        plain = self.cost[batch].predict(0) * window.steps
        self.probe_cost[batch] = max(0.0, window.seconds - plain)
        self.plain_seconds[batch] = 0.0

    def _no_drafts_below(self, batch: int) -> bool:
        """Whether a smaller batch size, priced at both ends, settled on K = 0. What drafting buys a
        request does not grow with the requests beside it, and what verifying costs does, so a
        batch size above one where drafting did not pay starts at K = 0 instead of paying for
        `hold` steps at max_k to find out (they cost most at the largest batches)."""
        return any(b < batch and k == 0 and set(self.ends) <= self.priced.get(b, set())
                   for b, k in self.verdict.items())

    def _borrowed_fit(self, batch: int) -> StepCost | ScaledStepCost | None:
        """The fit of the nearest batch size priced at both ends: one within a factor of 2 above as
        it is; one below scaled up to `batch` (ScaledStepCost) once K = 0 is priced here, or as it
        is within a factor of 2 for up to `cold_batch` requests. None: nothing to start from."""
        both = [b for b, ks in self.priced.items() if set(self.ends) <= ks and b != batch]
        usable = [b for b in both if batch < b <= 2 * batch or b < batch]
        nearest = min(usable, key=lambda b: (abs(math.log(b / batch)), b), default=None)
        if nearest is None or nearest > batch:
            return None if nearest is None else self.cost[nearest]
        if 0 in self.priced.get(batch, set()):
            return ScaledStepCost(self.cost[batch], self.cost[nearest], batch / nearest)
        return self.cost[nearest] if batch <= min(self.cold_batch, 2 * nearest) else None

    def drafting_ratio(self, batch: int, k: int) -> float | None:
        """A step's time at K = k over one at K = 0 at `batch` requests, from the fit the table
        chooses by (this batch size's own prices, or those it starts from: _borrowed_fit); None
        while there is none."""
        if k == 0:
            return None
        own = self.priced.get(batch, set())
        fit = self.cost[batch] if 0 in own and own - {0} else self._borrowed_fit(batch)
        return None if fit is None else fit.predict(k) / max(1e-9, fit.predict(0))

    def observe(self, scheduler_output: Any, sampled_token_ids: list[list[int]], busy_after: bool,
                req_ids: list[str] | None = None) -> None:
        """One step's output: price it when it only decoded and verified the K it drafted (requests
        the gate withheld verify none: the step is priced at their batch's mean drafts per request);
        `busy_after`: requests are still running (else the next interval includes idle time);
        `req_ids`: the requests of `sampled_token_ids`' rows (the gate reads them)."""
        now = self.clock()
        started, self.last_end = self.last_end, now if busy_after else None
        withheld = self.gate.withheld if self.gate is not None else frozenset()
        if self.gate is not None and req_ids is not None:
            self.gate.observe(scheduler_output, req_ids, sampled_token_ids)
        batch = len(scheduler_output.num_scheduled_tokens)
        if started is None or batch == 0:
            return
        k = scheduler_output.num_spec_tokens_to_schedule
        verified = [len(scheduler_output.scheduled_spec_decode_tokens.get(req, ())) for req in
                    scheduler_output.num_scheduled_tokens]
        gated = [req in withheld for req in scheduler_output.num_scheduled_tokens]
        only_decoding = scheduler_output.total_num_scheduled_tokens == batch + sum(verified)
        self.context[batch] = context_tokens(scheduler_output)
        if k == 0 and not any(verified) and scheduler_output.total_num_scheduled_tokens >= 4 * batch:
            per_token = (now - started) / scheduler_output.total_num_scheduled_tokens  # mostly a prefill
            self.token_seconds = per_token if self.token_seconds is None else \
                self.decay * self.token_seconds + (1 - self.decay) * per_token
        window = self.window.get(batch)
        if only_decoding and window is not None and window.k == k:  # every step of it, priced or not
            window.seconds += now - started
            window.steps += 1
            if k == 0 and not window.probe:
                self.plain_seconds[batch] = self.plain_seconds.get(batch, 0.0) + now - started
        if not only_decoding or any(v != k and not (v == 0 and g) for v, g in zip(verified, gated)) \
                or len(sampled_token_ids) != batch or (k and not any(verified)):
            return
        if batch not in self.cost:
            self.cost[batch] = self.new_cost()
        self.cost[batch].add(k * sum(1 for v in verified if v) / batch if k else 0, now - started)
        self.priced.setdefault(batch, set()).add(k)
        if any(gated) and req_ids is not None:  # the acceptance of chains: the requests that verified drafts
            sampled_token_ids = [t for r, t in zip(req_ids, sampled_token_ids) if r not in withheld]
        if k and self.tree_chain_k is not None and k == self.max_k:
            tokens = sum(len(t) for t in sampled_token_ids) / batch
            self.tree_yield = tokens if self.tree_yield is None else \
                self.decay * self.tree_yield + (1 - self.decay) * tokens
        elif k:
            self.acceptance.observe(k, [max(0, min(k, len(t) - 1)) for t in sampled_token_ids])


def context_tokens(scheduler_output: Any) -> int:
    """The tokens a step's requests hold once it has run: those computed before it and those it
    schedules (vLLM's NewRequestData / CachedRequestData, where the output carries them)."""
    held = scheduler_output.total_num_scheduled_tokens
    held += sum(getattr(r, "num_computed_tokens", 0) for r in getattr(scheduler_output, "scheduled_new_reqs", ()))
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    return held + sum(getattr(cached, "num_computed_tokens", ()) or ())


CHECKED_ATTR = "_vllm_moa_adaptive_checked"  # set on a scheduler once SchedulerUpdatePatch has looked


class SchedulerUpdatePatch(VllmPatch):
    """Scheduler.update_from_output: for a "moa" engine whose K follows measured speed
    (moa_defaults.requested_adaptive), install AdaptiveK as the scheduler's K table on the first
    step, then feed it each step's output."""

    symbol = "scheduler_update_from_output"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def update_from_output(self, scheduler_output, model_runner_output):
            if not hasattr(self, CHECKED_ATTR):  # once per scheduler: is it a "moa" engine with K by speed?
                setattr(self, CHECKED_ATTR, True)
                if self.dynamic_sd_lookup is not None and adaptive_engine(self.vllm_config):
                    spec = self.vllm_config.speculative_config
                    self.dynamic_sd_lookup = AdaptiveK(spec.num_speculative_tokens, tree_chain_k=chain_k_of_tree(spec))
            table = self.dynamic_sd_lookup
            outputs = original(self, scheduler_output, model_runner_output)
            if isinstance(table, AdaptiveK):
                table.observe(scheduler_output, model_runner_output.sampled_token_ids, bool(self.running),
                              model_runner_output.req_ids)
            return outputs

        setattr(owner, attr, update_from_output)


def chain_k_of_tree(speculative_config: Any) -> int | None:
    """The longest chain a tree engine falls back to (moa_defaults.tree_chain_k), None for chains."""
    tree = requested_tree(speculative_config)
    return None if tree is None else tree_chain_k(tree.depth, speculative_config.num_speculative_tokens)


def adaptive_engine(vllm_config: Any) -> bool:
    """Whether this engine's speculative config is "moa" with K by measured speed."""
    from vllm_moa.integration.shell import compat

    spec = vllm_config.speculative_config
    return spec is not None and spec.method == compat.METHOD and requested_adaptive(spec)
