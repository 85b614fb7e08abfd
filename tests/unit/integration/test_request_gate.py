"""K by request (integration/shell/request_gate.py): in a step that drafts K, the requests whose
own drafts do not pay verify none, measured on steps shaped as vLLM's scheduler outputs, with a
clock the test controls."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from vllm_moa.decoding.speed_control import GeometricAcceptance
from vllm_moa.integration.shell.adaptive_k import AdaptiveK
from vllm_moa.integration.shell.request_gate import RequestGate, SchedulerDraftsPatch

MAX_K = 3
GOOD, BAD = 5, 9  # a request's draft tokens; the target samples GOOD for every request


class Engine:
    """Steps of decoding requests: K from the table, each request's drafts through the gate (when
    `gated`), a step costing `base` + `per_token` per verified draft + `drafting` when K > 0; a
    request in `accepts` accepts that many of its drafts, one not in it none (its drafts are BAD,
    and the target's token is GOOD, so a withheld draft is seen not to match)."""

    def __init__(self, requests: list[str], accepts: dict[str, int], gated: bool = True, base: float = 0.03,
                 per_token: float = 0.001, drafting: float = 0.003) -> None:
        self.now, self.requests, self.accepts = 0.0, requests, accepts
        self.base, self.per_token, self.drafting = base, per_token, drafting
        self.table = AdaptiveK(MAX_K, clock=lambda: self.now)
        if gated:
            self.table.gate = RequestGate(self.table)
        self.drafts: dict[str, list[int]] = {}
        self.tokens = 0
        self.verified_steps: dict[str, int] = {r: 0 for r in requests}

    def step(self) -> int:
        batch = len(self.requests)
        k = self.table[batch]
        verified = {r: self.drafts[r][:k] for r in self.requests if self.drafts.get(r) and k}
        scheduled = {r: 1 + len(verified.get(r, ())) for r in self.requests}
        output = SimpleNamespace(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                                 scheduled_spec_decode_tokens=verified, num_spec_tokens_to_schedule=k,
                                 scheduled_new_reqs=[], finished_req_ids=set(),
                                 scheduled_cached_reqs=SimpleNamespace(num_computed_tokens=[100] * batch))
        self.now += self.base + self.per_token * sum(len(v) for v in verified.values()) + (self.drafting if k else 0)
        sampled = [[GOOD] * (1 + min(self.accepts.get(r, 0), len(verified.get(r, ())))) for r in self.requests]
        for r in verified:
            self.verified_steps[r] += 1
        self.tokens += sum(len(t) for t in sampled)
        self.table.observe(output, sampled, True, list(self.requests))
        drafts = [[GOOD if r in self.accepts else BAD] * k for r in self.requests]
        if self.table.gate is not None:
            drafts = self.table.gate.filter(list(self.requests), drafts)
        self.drafts = dict(zip(self.requests, drafts))
        return k

    def run(self, steps: int) -> float:
        """Tokens per second over `steps` steps."""
        t0, n0 = self.now, self.tokens
        for _ in range(steps):
            self.step()
        return (self.tokens - n0) / (self.now - t0)


def test_requests_whose_drafts_are_never_accepted_verify_none_while_the_others_draft():
    """Two requests accept 3 of 3 drafts, two accept none: once the batch size is priced, the two
    that accept none verify no drafts, the others keep drafting, and the engine produces more
    tokens per second than the same engine verifying every request's drafts."""
    requests = ["a", "b", "x", "y"]
    gated = Engine(requests, {"a": 3, "b": 3})
    plain = Engine(requests, {"a": 3, "b": 3}, gated=False)
    gated.run(60), plain.run(60)
    before = dict(gated.verified_steps)
    assert gated.run(200) > 1.05 * plain.run(200)
    drafted = {r: gated.verified_steps[r] - before[r] for r in requests}
    assert drafted["a"] > 150 and drafted["b"] > 150, drafted
    assert drafted["x"] < 20 and drafted["y"] < 20, drafted
    assert gated.table.gate.drafts_withheld > 300


def test_a_withheld_request_drafts_again_when_its_drafts_would_be_accepted():
    """A request withheld while its drafts missed is measured on its withheld first draft: when
    that draft starts to be the target's token, the request verifies drafts again, no probe."""
    engine = Engine(["a", "x"], {"a": 3})
    engine.run(50)
    before = engine.verified_steps["x"]
    engine.run(100)
    assert engine.verified_steps["x"] - before < 15
    engine.accepts["x"] = 3  # x's drafts are now GOOD: the target samples them
    before = engine.verified_steps["x"]
    engine.run(100)
    assert engine.verified_steps["x"] - before > 60


def test_nothing_is_withheld_before_the_batch_size_is_priced():
    """The gate waits for the batch size's own prices (K = 0 and some K > 0)."""
    table = AdaptiveK(MAX_K)
    gate = RequestGate(table)
    assert gate.filter(["a", "b"], [[BAD] * 3, [GOOD] * 3]) == [[BAD] * 3, [GOOD] * 3]
    assert gate.withheld == frozenset()


def test_a_request_left_alone_is_judged_by_its_own_drafts():
    """Two requests that accept every draft finish; one that accepts none runs on alone. The
    table's acceptance rate is theirs, which alone would keep drafting; the gate withholds the lone
    request's drafts by its own rate, and the table, reading the same rates, stops drafting."""
    engine = Engine(["a", "b"], {"a": 3, "b": 3})
    engine.run(100)
    engine.requests, engine.verified_steps["x"] = ["x"], 0
    engine.run(20)
    before = engine.verified_steps["x"]
    ks = [engine.step() for _ in range(100)]
    assert engine.verified_steps["x"] - before < 15
    assert sum(k > 0 for k in ks) < 15, ks
    assert engine.table.acceptance.rate > 0.8  # one rate for all would still price drafting as paying


def test_acceptance_of_the_engine_counts_only_requests_that_verified_drafts():
    """Withheld requests verify no drafts: the table's per-level rate is measured on the requests
    that did, not dragged down by zeros that were never drafts."""
    engine = Engine(["a", "b", "x", "y"], {"a": 3, "b": 3})
    engine.run(300)
    assert engine.table.acceptance.rate > 0.8


@dataclass
class Drafts:
    """vLLM's DraftTokenIds (a dataclass of these two fields)."""

    req_ids: list[str]
    draft_token_ids: list[list[int]]


@dataclass
class FakeScheduler:
    """The two attributes of vLLM's Scheduler the patch reads, and what it was given."""

    dynamic_sd_lookup: object
    vllm_config: object
    given: list | None = None

    def update_draft_token_ids(self, draft_token_ids):
        self.given = draft_token_ids.draft_token_ids


@pytest.mark.parametrize("async_scheduling, env, gated", [(False, "1", True), (True, "1", False),
                                                          (False, "0", False), (False, None, False)])
def test_the_patch_gates_drafts_only_with_synchronous_scheduling_and_the_variable_on(
        monkeypatch, async_scheduling, env, gated):
    """SchedulerDraftsPatch builds the gate on a scheduler's first update for a chain engine with K
    by measured speed and synchronous scheduling, when VLLM_MOA_DRAFTS_BY_REQUEST=1 (off by default)."""
    if env is None:
        monkeypatch.delenv("VLLM_MOA_DRAFTS_BY_REQUEST", raising=False)
    else:
        monkeypatch.setenv("VLLM_MOA_DRAFTS_BY_REQUEST", env)

    class Scheduler(FakeScheduler):
        pass

    SchedulerDraftsPatch._patch(Scheduler, "update_draft_token_ids")
    engine = Engine(["a", "x"], {"a": 3}, gated=False)
    engine.run(150)  # priced at 2 requests
    config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))
    scheduler = Scheduler(engine.table, config)
    scheduler.update_draft_token_ids(Drafts(["a", "x"], [[GOOD] * 3, [BAD] * 3]))  # the first builds the gate
    assert (engine.table.gate is not None) == gated
    if gated:
        engine.table.gate.rates["x"] = GeometricAcceptance(0.01, 100.0)  # x's drafts measured as never accepted
        engine.table.gate.rates["a"] = GeometricAcceptance(0.95, 100.0)
    scheduler.update_draft_token_ids(Drafts(["a", "x"], [[GOOD] * 3, [BAD] * 3]))
    assert (scheduler.given == [[GOOD] * 3, []]) == gated
