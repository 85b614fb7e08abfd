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
* a batch size above one priced at both ends whose verdict is K = 0 starts at K = 0 (drafting
  pays less, not more, with more requests beside it) and is priced from there;
* per batch size B, a step's time: K = 0 steps on their own, drafting steps fitted as c + s * K
  (decoding.speed_control's WeightedLinearFit; K = max_k and K = 0 are priced first, so a K in
  between costs as much as K = max_k until it is priced itself); what a step
  yields is B * E(K) tokens, E(K) = 1 + a + ... + a^K from one per-level acceptance rate `a`
  measured over every drafted position at any batch size (GeometricAcceptance, as the
  runtime's speed control); the K of most B * E(K) / (c + s * K) tokens per second is chosen,
  and the end (max_k or 0) that was not chosen is re-tried now and then; a batch size not yet
  priced at both ends borrows the fit of the nearest one within a factor of 2 that is.

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
from vllm_moa.integration.shell.patching import VllmPatch


@dataclass
class StepCost:
    """A batch size's step time: K = 0 steps (no drafter, nothing to verify) apart from drafting
    ones, which also pay a cost of drafting at all (the drafter's call, the rejection sampler), so
    that a line through K = 0 and K = max_k would promise small K too cheaply. Drafting steps are
    fitted as c + s * K over the K priced (one K priced: the same time for every K >= 1)."""

    plain: WeightedLinearFit
    drafting: WeightedLinearFit

    def predict(self, k: int) -> float:
        return self.plain.predict(0, 1.0) if k == 0 else self.drafting.predict(k, 1.0)

    def add(self, k: int, seconds: float) -> None:
        (self.drafting if k else self.plain).add(k, seconds)


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
                 probe_budget: float = 0.03, decay: float = 0.95,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self.max_k, self.hold, self.clock, self.decay = max_k, hold, clock, decay
        self.min_probe_every, self.max_probe_every, self.probe_budget = probe_every, max_probe_every, probe_budget
        # one per-level acceptance rate for every batch size (what a draft is worth does not
        # depend on how many requests run beside it); the last ~512 drafted positions count
        self.acceptance = GeometricAcceptance(memory_trials=512.0)
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

    def __getitem__(self, batch: int) -> int:
        window = self.window.get(batch)
        if window is None or window.left <= 0:
            self._close(batch)
            window = self.window[batch] = Window(*self.choose(batch), left=self.hold)
        window.left -= 1
        return window.k

    def tokens_per_second(self, batch: int, k: int, fit: StepCost) -> float:
        return batch * self.acceptance.expected_tokens(k) / max(1e-9, fit.predict(k))

    def choose(self, batch: int) -> tuple[int, bool]:
        """(K, probe) of the next `hold` steps at `batch` requests: K = max_k, then K = 0, priced
        at this batch size (or the verdict of one within a factor of 2 that has both); then the K
        of most estimated tokens per second, and every `probe_every`-th choice the end (max_k or
        0) that was not chosen or not priced here, the interval doubling while the verdict holds.
        A drafting probe while K = 0 is chosen also waits until the K = 0 steps since the last
        one took 1 / probe_budget times what that one cost beyond them."""
        priced = self.priced.get(batch, set())
        fit = self.cost[batch] if {0, self.max_k} <= priced else self._nearest_fit(batch)
        if fit is None:
            if self._no_drafts_below(batch):  # drafting did not pay with fewer requests: nor here
                return 0, False
            return (self.max_k if self.max_k not in priced else 0), False
        best = max(range(self.max_k + 1), key=lambda k: self.tokens_per_second(batch, k, fit))
        every = self.probe_every.setdefault(batch, self.min_probe_every)
        if self.verdict.get(batch, best) != best:
            self.probe_every[batch] = every = self.min_probe_every  # the verdict moved: watch closely again
        self.verdict[batch] = best
        self.choices[batch] = self.choices.get(batch, 0) + 1
        missing = [k for k in (self.max_k, 0) if k not in priced and k != best]
        probe = missing[0] if missing else (0 if best else self.max_k)
        # before any drafting probe was priced here: what `hold` steps at max_k cost beyond K = 0
        # (the drafter's catch-up comes on top)
        first_guess = self.hold * max(0.0, fit.predict(self.max_k) - fit.predict(0))
        affordable = probe == 0 or best != 0 or \
            self.plain_seconds.get(batch, 0.0) * self.probe_budget >= self.probe_cost.get(batch, first_guess)
        if self.choices[batch] < every or not affordable:
            return best, False
        self.choices[batch] = 0
        if not missing:
            self.probe_every[batch] = min(self.max_probe_every, 2 * every)
        return probe, True

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
        return any(b < batch and k == 0 and {0, self.max_k} <= self.priced.get(b, set())
                   for b, k in self.verdict.items())

    def _nearest_fit(self, batch: int) -> StepCost | None:
        near = [b for b, ks in self.priced.items() if {0, self.max_k} <= ks and abs(math.log(b / batch)) <= math.log(2)]
        nearest = min(near, key=lambda b: (abs(math.log(b / batch)), b), default=None)
        return None if nearest is None else self.cost[nearest]

    def observe(self, scheduler_output: Any, sampled_token_ids: list[list[int]], busy_after: bool) -> None:
        """One step's output: price it when it only decoded and verified the K it drafted;
        `busy_after`: requests are still running (else the next interval includes idle time)."""
        now = self.clock()
        started, self.last_end = self.last_end, now if busy_after else None
        batch = len(scheduler_output.num_scheduled_tokens)
        if started is None or batch == 0:
            return
        k = scheduler_output.num_spec_tokens_to_schedule
        verified = [len(scheduler_output.scheduled_spec_decode_tokens.get(req, ())) for req in
                    scheduler_output.num_scheduled_tokens]
        only_decoding = scheduler_output.total_num_scheduled_tokens == batch + sum(verified)
        window = self.window.get(batch)
        if only_decoding and window is not None and window.k == k:  # every step of it, priced or not
            window.seconds += now - started
            window.steps += 1
            if k == 0 and not window.probe:
                self.plain_seconds[batch] = self.plain_seconds.get(batch, 0.0) + now - started
        if not only_decoding or any(v != k for v in verified) or len(sampled_token_ids) != batch:
            return
        self.cost.setdefault(batch, StepCost(WeightedLinearFit(self.decay), WeightedLinearFit(self.decay))).add(
            k, now - started)
        self.priced.setdefault(batch, set()).add(k)
        if k:
            self.acceptance.observe(k, [max(0, min(k, len(t) - 1)) for t in sampled_token_ids])


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
                    self.dynamic_sd_lookup = AdaptiveK(self.vllm_config.speculative_config.num_speculative_tokens)
            table = self.dynamic_sd_lookup
            outputs = original(self, scheduler_output, model_runner_output)
            if isinstance(table, AdaptiveK):
                table.observe(scheduler_output, model_runner_output.sampled_token_ids, bool(self.running))
            return outputs

        setattr(owner, attr, update_from_output)


def adaptive_engine(vllm_config: Any) -> bool:
    """Whether this engine's speculative config is "moa" with K by measured speed."""
    from vllm_moa.integration.shell import compat
    from vllm_moa.integration.shell.moa_defaults import requested_adaptive

    spec = vllm_config.speculative_config
    return spec is not None and spec.method == compat.METHOD and requested_adaptive(spec)
