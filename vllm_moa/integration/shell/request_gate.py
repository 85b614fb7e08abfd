"""K by request inside vLLM: in a step whose batch drafts K, a request whose own drafts do not pay
verifies none of them, and the others verify theirs.

K by measured speed (adaptive_k.py) chooses one K per batch size from one acceptance rate. Requests
differ: at temperature 1.5 MoA's drafts are almost never accepted on SmolLM2 (vLLM's acceptance
length 1.03-1.05, against 2.9-3.2 greedy on the same prompts), and a request that repeats its
prompt accepts far more through lookup than one that does not. Verifying a request's K drafts costs
the target K more tokens in the step whatever they are worth, so the drafts of a request that
accepts little slow the batch down for everyone.

vLLM takes drafts per request (its n-gram proposer returns an empty list for a request without a
match, and the scheduler then schedules that request's token alone), so the gate works where the
drafts reach vLLM's scheduler (`Scheduler.update_draft_token_ids`, vLLM's synchronous scheduling;
vLLM's CPU platform always schedules synchronously; asynchronous scheduling keeps the drafts on the
device and is left as it is): `SchedulerDraftsPatch` empties the drafts of the requests that do
not pay, after the drafter ran (drafting is done for the whole batch at once; what the gate saves
is the target verifying them).

The rule, per step at batch size B and K > 0, once K by measured speed has priced B at K = 0 and at
some K > 0 (a step at K costs rho = t(K) / t(0) times one at K = 0, t from adaptive_k's StepCost):
each request r has its own per-level acceptance rate (GeometricAcceptance over its last ~24
drafted positions, its prior the engine's rate), so E_r = 1 + a_r + ... + a_r^K tokens per step
if it drafts. Its drafts cost about its share of the drafting steps' extra time, (t(K) - t(0)) / B,
and bring E_r - 1 tokens, each worth t(K) / (B * mean E) of the step; so r drafts when

    E_r - 1 >= mean(E) * (1 - 1 / rho)

(the mean over the requests that drafted). A request whose rate equals the engine's drafts exactly
when the batch's drafting pays (E >= rho), as the table chose; a request alone drafts when its own
drafts pay (E_r >= rho), where the table judged by every request's drafts (one that accepts
little, left alone when the others finished, would otherwise draft at the rate they accepted). Its share includes drafting, which
withholding does not save, so the rule withholds a little more readily than a perfect split would.

A withheld request is still measured: its first draft is compared with the token the target
samples for it next (greedy: exactly whether that draft would have been accepted), so it drafts
again when its drafts would pay again, without a probe. The table's own choice of K reads the same
rates (`step_rate`): a step's tokens are counted per request of the running batch, the withheld
ones at 1, its time at their mean drafts per request; so a batch of requests whose drafts do not
pay (one left alone, say) chooses K = 0 and stops drafting at all, which withholding alone does
not (the drafter drafts for the whole batch). Trees are not gated (a tree engine's
steps are verified along the tree as planned for every request; they still climb down the
ladder of K by measured speed). Off by default: VLLM_MOA_DRAFTS_BY_REQUEST=1 turns it on. On
SmolLM2 in vLLM's CPU engine, half the requests greedy and half at T = 1.5
(benchmarks/vllm_mixed_requests.py), it cut the sampled requests' verified drafts about tenfold
but the engine ran slower than with one K for all: the table, reading these rates, drafted for the
greedy requests where the drafting steps cost more than its fit predicted (docs/vllm-plugin.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from vllm_moa import envs
from vllm_moa.decoding.speed_control import GeometricAcceptance
from vllm_moa.integration.shell.adaptive_k import AdaptiveK
from vllm_moa.integration.shell.patching import VllmPatch


class RequestGate:
    """Which requests' drafts a step verifies (the module docstring's rule), and each request's
    acceptance rate, measured on the drafts it verified and on the first draft it withheld."""

    def __init__(self, table: AdaptiveK, memory_trials: float = 24.0, prior_weight: float = 2.0) -> None:
        self.table, self.memory_trials, self.prior_weight = table, memory_trials, prior_weight
        self.rates: dict[str, GeometricAcceptance] = {}
        self.shadow: dict[str, int] = {}  # request -> the first draft withheld from its next step
        self.withheld: frozenset[str] = frozenset()  # the requests withheld from the next step
        self.current: list[str] = []  # the requests of the last step
        self.drafts_withheld = 0  # request-steps whose drafts were withheld
        self.drafts_kept = 0  # request-steps whose drafts were kept where the gate was deciding

    def rate(self, request: str) -> GeometricAcceptance:
        if request not in self.rates:
            self.rates[request] = GeometricAcceptance(self.table.acceptance.rate, self.prior_weight,
                                                      memory_trials=self.memory_trials)
        return self.rates[request]

    def floor(self, batch: int, k: int, expected: list[float]) -> float | None:
        """The least tokens per step (E_r) a request's drafts must bring at `batch` and K = k; None
        while the batch size's step times are not priced at K = 0 and some K > 0."""
        ratio = self.table.drafting_ratio(batch, k)
        return None if ratio is None or not expected else floor_of(expected, ratio)

    def step_rate(self, batch: int, k: int, fit: Any) -> float | None:
        """Tokens per second of a step at K = k over the requests of the last step, each drafting
        only where the rule lets it: their tokens (E_r for those that draft, 1 for the others) over
        the step's time at their mean drafts per request (the table's fit, whose drafting line is
        priced that way). None when the last step's requests are not `batch` of them, or k = 0."""
        if k == 0 or len(self.current) != batch:
            return None
        expected = [self.rate(r).expected_tokens(k) for r in self.current]
        floor = floor_of(expected, fit.predict(k) / max(1e-9, fit.predict(0)))
        kept = [e for e in expected if e >= floor]
        return (sum(kept) + batch - len(kept)) / max(1e-9, fit.predict(k * max(1, len(kept)) / batch))

    def filter(self, req_ids: list[str], drafts: list[list[int]]) -> list[list[int]]:
        """The drafts each request verifies next step: its own, or none (module docstring)."""
        k = max((len(d) for d in drafts), default=0)
        expected = {r: self.rate(r).expected_tokens(k) for r, d in zip(req_ids, drafts) if d}
        floor = self.floor(len(req_ids), k, list(expected.values())) if k else None
        withheld: set[str] = set()
        if floor is not None:
            for r, d in zip(req_ids, drafts):
                if d and expected[r] < floor:
                    withheld.add(r)
                    self.shadow[r] = d[0]
            self.drafts_withheld += len(withheld)
            self.drafts_kept += len(expected) - len(withheld)
        self.withheld = frozenset(withheld)
        return [[] if r in withheld else d for r, d in zip(req_ids, drafts)]

    def observe(self, scheduler_output: Any, req_ids: list[str], sampled_token_ids: list[list[int]]) -> None:
        """A step's output: each request's accepted drafts, or whether the draft withheld from it was
        the token the target sampled; requests that finished are forgotten."""
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        self.current = list(req_ids)
        for request, tokens in zip(req_ids, sampled_token_ids):
            shadow = self.shadow.pop(request, None)
            if not tokens:
                continue
            verified = len(scheduled.get(request, ()))
            if verified:
                self.rate(request).observe(verified, max(0, min(verified, len(tokens) - 1)))
            elif shadow is not None:
                self.rate(request).observe(1, int(tokens[0] == shadow))
        for request in scheduler_output.finished_req_ids:
            self.rates.pop(request, None)
            self.shadow.pop(request, None)


def floor_of(expected: list[float], ratio: float) -> float:
    """The rule's least E_r: 1 + mean(E) * (1 - 1 / rho) (the module docstring)."""
    return 1.0 + sum(expected) / len(expected) * (1.0 - 1.0 / ratio)


def gated_engine(table: Any, vllm_config: Any) -> bool:
    """Whether this scheduler's drafts go through a RequestGate: K by measured speed for chains,
    synchronous scheduling, VLLM_MOA_DRAFTS_BY_REQUEST=1."""
    return (isinstance(table, AdaptiveK) and table.tree_chain_k is None and envs.VLLM_MOA_DRAFTS_BY_REQUEST
            and not vllm_config.scheduler_config.async_scheduling)


CHECKED_ATTR = "_vllm_moa_gate_checked"  # set on a scheduler once SchedulerDraftsPatch has looked


class SchedulerDraftsPatch(VllmPatch):
    """Scheduler.update_draft_token_ids: in a "moa" chain engine with K by measured speed, each
    request's drafts pass the RequestGate (built on the first call, fed through AdaptiveK.observe)."""

    symbol = "scheduler_update_draft_token_ids"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def update_draft_token_ids(self, draft_token_ids):
            table = self.dynamic_sd_lookup
            if not hasattr(self, CHECKED_ATTR):  # once per scheduler, after AdaptiveK was installed
                setattr(self, CHECKED_ATTR, True)
                if gated_engine(table, self.vllm_config):
                    table.gate = RequestGate(table)
            gate = table.gate if isinstance(table, AdaptiveK) else None
            if gate is not None and draft_token_ids.draft_token_ids:
                draft_token_ids = dataclasses.replace(
                    draft_token_ids, draft_token_ids=gate.filter(list(draft_token_ids.req_ids),
                                                                 draft_token_ids.draft_token_ids))
            return original(self, draft_token_ids)

        setattr(owner, attr, update_draft_token_ids)
