"""AdaptiveK, the scheduler's K table measured instead of written (integration/shell/adaptive_k.py),
driven by steps shaped as vLLM's scheduler outputs, with a clock the test controls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_moa.integration.shell.adaptive_k import AdaptiveK

MAX_K = 3


class Engine:
    """Steps of `batch` decoding requests at the K the table gives, each taking `cost(batch, K)`
    seconds and yielding `accepted(K)` + 1 tokens per request; the previous step's K is verified."""

    def __init__(self, cost, accepted, max_k: int = MAX_K, **table) -> None:
        self.now, self.cost, self.accepted = 0.0, cost, accepted
        self.table = AdaptiveK(max_k, clock=lambda: self.now, **table)
        self.drafted: dict[str, int] = {}
        self.context = 0  # tokens each request holds before a step (those that end are replaced)

    def step(self, batch: int, prefill: int = 0, busy_after: bool = True) -> int:
        k = self.table[batch]
        reqs = [f"r{i}" for i in range(batch)]
        verified = {r: [7] * self.drafted.get(r, 0) for r in reqs if self.drafted.get(r, 0)}
        tokens = {r: 1 + len(verified.get(r, ())) + (prefill if r == "r0" else 0) for r in reqs}
        output = SimpleNamespace(num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
                                 scheduled_spec_decode_tokens=verified, num_spec_tokens_to_schedule=k,
                                 scheduled_new_reqs=[],
                                 scheduled_cached_reqs=SimpleNamespace(num_computed_tokens=[self.context] * batch))
        self.now += self.cost(batch, k)
        sampled = [[1] * (1 + min(self.accepted(len(verified.get(r, ()))), len(verified.get(r, ())))) for r in reqs]
        self.table.observe(output, sampled, busy_after)
        self.drafted = {r: k for r in reqs}
        return k


def accepts_two(k: int) -> int:
    return min(k, 2)


def test_small_batches_draft_and_large_ones_turn_drafting_down():
    """Drafting costs 5% of a step per token at batch 1 (it pays) and 90% at batch 16 (it does
    not): after pricing K = 3 and K = 0, batch 1 settles on drafting and batch 16 on K = 0."""
    engine = Engine(lambda b, k: 0.01 * b ** 0.5 * (1 + (0.05 if b == 1 else 0.9) * k), accepts_two)
    ones = [engine.step(1) for _ in range(200)]
    sixteens = [engine.step(16) for _ in range(200)]
    assert ones[:7] == [3, 3, 3, 0, 0, 0, 3], "K = max_k, then K = 0, priced first"
    assert sum(k >= 2 for k in ones[-100:]) > 80
    assert sum(k == 0 for k in sixteens[-100:]) > 80


def test_a_batch_size_above_one_that_settled_on_k_0_starts_at_k_0():
    """Batch 4 priced at both ends settles on K = 0; batch 16 (nothing priced within a factor of 2)
    then prices K = 0 and stays there, with drafting as measured at 4 scaled to 16 requests, instead
    of pricing K = max_k first, which costs most there; a smaller batch size (2, within a factor of
    2 of 4) takes 4's verdict, and one with nothing near it (1) still prices max_k first."""
    engine = Engine(lambda b, k: 0.01 * b ** 0.5 * (1 + 0.9 * k), accepts_two)
    fours = [engine.step(4) for _ in range(60)]
    assert fours[:6] == [3, 3, 3, 0, 0, 0] and engine.table.verdict[4] == 0
    assert [engine.step(16) for _ in range(30)] == [0] * 30
    assert [engine.step(2) for _ in range(3)] == [0] * 3
    assert [engine.step(1) for _ in range(3)] == [3, 3, 3]


def test_a_fresh_engine_s_first_large_batch_costs_what_no_speculation_costs():
    """A fresh engine whose first steps run 48 requests (`vllm bench throughput`'s) starts at K = 0
    and waits for a drafting probe until K = 0 time pays for it at probe_budget: before any probe
    was priced its cost is guessed with the drafter's catch-up over every token the requests hold
    (200 each here, at 0.5 ms a token, the cost of a prefill token measured from a mixed step), so
    a short run drafts nothing, and a long one drafts within the budget."""
    state = {"last": 0}

    def cost(batch, k):
        catch_up = 48 * 200 * 0.0005 if k and state["last"] == 0 else 0.0
        state["last"] = k
        return 0.1 * (1 + k) + catch_up  # drafting never pays at 48

    engine = Engine(cost, accepts_two)
    engine.step(48, prefill=400)
    assert engine.table.token_seconds is None  # the first step after idle time is not timed
    engine.step(48, prefill=400)  # 448 tokens, timed: a prefill token's cost
    assert engine.table.token_seconds == pytest.approx(0.1 / 448)
    engine.table.token_seconds = 0.0005
    engine.context = 200  # the requests' prompts and answers so far
    short = [engine.step(48) for _ in range(128)]
    assert short == [0] * 128
    long = [engine.step(48) for _ in range(8000)]
    assert 0 < sum(k != 0 for k in long) < 0.03 * len(long)


def test_a_growing_load_drafts_where_drafting_as_scaled_still_pays():
    """Drafting that costs little per request (a GPU's verification): priced at batch 4, it is
    scaled to batch 16 after 16's own K = 0 steps; that prices a cheap first probe, which 16's own
    prices then confirm, and 16 drafts from there. Where drafting's cost grows with the requests
    (a CPU's), 16 stays at K = 0: a scaled verdict never starts drafting above 4 requests, since
    switching drafting on also makes the drafter catch up over every request."""
    cheap = Engine(lambda b, k: 0.01 * (1 + 0.01 * b * k), accepts_two)
    [cheap.step(4) for _ in range(30)]
    assert cheap.table.verdict[4] > 0
    sixteens = [cheap.step(16) for _ in range(200)]
    assert sixteens[:3] == [0, 0, 0] and sum(k > 0 for k in sixteens[-60:]) >= 54, sixteens
    patient = Engine(lambda b, k: 0.01 * (1 + 0.01 * b * k), accepts_two)
    [patient.step(4) for _ in range(30)]
    patient.context, patient.table.token_seconds = 2000, 0.0005  # a catch-up over 16 x 2,000 tokens: 16 s
    assert [patient.step(16) for _ in range(60)] == [0] * 60  # the scaled verdict alone never drafts
    dear = Engine(lambda b, k: 0.01 * b ** 0.3 * (1 + 0.15 * b ** 0.7 * k), accepts_two)
    fours = [dear.step(4) for _ in range(30)]
    assert dear.table.verdict[4] > 0, fours  # drafting pays at 4
    assert [dear.step(16) for _ in range(30)] == [0] * 30


def test_drafting_probes_cost_at_most_the_budget_when_catching_up_is_dear():
    """While K = 0 pays at batch 16, a drafting probe's first step also catches the drafter up (10
    K = 0 steps' time here): probes then wait until the K = 0 time since the last one is 1 /
    probe_budget times that cost, so over a long run they take a few percent of the time (probes
    every 4th choice here, were they free)."""
    state = {"last": 0}

    def cost(batch, k):
        dear = 10 * 0.04 if k and state["last"] == 0 else 0.0  # the catch-up after K = 0 steps
        state["last"] = k
        return 0.04 * (1 + 0.9 * k) + dear

    engine = Engine(cost, accepts_two, probe_every=4, max_probe_every=4)
    ks = [engine.step(16) for _ in range(2000)]
    drafting = sum(k != 0 for k in ks[6:])
    assert 0 < drafting < 0.03 * len(ks), drafting


def verdict_moves(switch_margin: float, seed: int) -> int:
    """Moves of batch 1's verdict between drafting and K = 0 after 300 steps, where a step at K = 3
    (every draft accepted) costs what its tokens are worth (a tie) and each step's time wanders by
    +-10%."""
    import random

    noise = random.Random(seed)
    engine = Engine(lambda b, k: 0.01 * (1 if k == 0 else 3.94) * noise.uniform(0.9, 1.1), lambda k: k,
                    switch_margin=switch_margin)
    verdicts = []
    for _ in range(3000):
        engine.step(1)
        verdicts.append(engine.table.verdict.get(1))
    drafting = [v != 0 for v in verdicts[300:]]
    return sum(a != b for a, b in zip(drafting, drafting[1:]))


def test_near_a_tie_the_verdict_holds():
    """switch_margin: the verdict leaves drafting (or K = 0) only for an estimate 5% ahead, so a
    tie on a noisy machine does not flip it (each move back to drafting catches the drafter up);
    with no margin the same steps move it."""
    assert sum(verdict_moves(0.05, seed) for seed in range(4)) == 0
    assert sum(verdict_moves(0.0, seed) for seed in range(4)) > 0


def test_steps_that_cannot_be_priced_are_not():
    """A step with a prefill, a step that verifies drafts of another K, and the first step after
    the engine went idle are not priced: the table's estimates stay as they were."""
    engine = Engine(lambda b, k: 0.01, accepts_two)
    def priced():
        return {b: (cost.plain.sw, cost.drafting.sw, cost.drafting.sy) for b, cost in engine.table.cost.items()}

    engine.step(4)  # no previous end: not priced
    assert priced() == {}
    engine.step(4, prefill=20)
    assert priced() == {}
    engine.step(4, busy_after=False)  # priced (K held), but the next interval includes idle time
    after_idle = priced()
    assert after_idle
    engine.now += 100.0
    assert engine.step(4) == 0  # after idle time, and verifying K = 3's drafts: not priced
    assert priced() == after_idle
    engine.step(4)  # K = 0 verifying K = 0: priced
    assert priced() != after_idle


def test_a_k_is_held_for_a_few_steps_so_that_steps_verify_their_own_k():
    engine = Engine(lambda b, k: 0.01, accepts_two)
    ks = [engine.step(2) for _ in range(12)]
    assert ks[:3] == [ks[0]] * 3 and ks[3:6] == [ks[3]] * 3


def test_a_fixed_cost_of_drafting_at_all_keeps_small_k_from_looking_cheap():
    """Drafting at all costs 0.9 of a K = 0 step, each drafted token 0.1 more, and one draft in two
    is accepted: K = 1 is slower than K = 0 (a line through K = 0 and K = 3 would call it faster);
    after pricing K = 3 and K = 0 the table settles on K = 0, not on K = 1."""
    engine = Engine(lambda b, k: 0.05 * (1 + (0.9 + 0.1 * k if k else 0)), lambda k: min(k, 1))
    ks = [engine.step(4) for _ in range(300)]
    assert sum(k == 0 for k in ks[6:]) > 0.9 * len(ks[6:]) and 1 not in ks


TREE = 8  # a tree engine's node budget (max_k); its chains are at most 3 long


def tree_engine(tree_step: float, **table) -> Engine:
    """A tree of 8 nodes yields 5 tokens per request and step and costs `tree_step` K = 0 steps;
    a chain of K accepts min(K, 2) drafts for 1 + 0.05 * K K = 0 steps (1 + 0.3 * K at 16 requests)."""
    def cost(batch, k):
        if k == TREE:
            return 0.01 * tree_step * (1 if batch == 1 else 3)
        return 0.01 * (1 + (0.05 if batch == 1 else 0.3) * k)

    return Engine(cost, lambda k: 4 if k == TREE else min(k, 2), max_k=TREE, **table)


def test_a_tree_engine_falls_back_to_the_chain_that_pays_then_to_k_0():
    """A tree whose step costs three plain ones (vLLM's CPU engine: the tree mask) against its 5
    tokens: after pricing the tree, the chain of 3 and K = 0, one request settles on a chain (3
    tokens for 1.15 steps) and 16 on K = 0; a tree that costs 1.8 steps is kept (priced at its
    tokens as measured: the chains' acceptance rate would price 8 levels at ~2.9). Without the
    ladder (every K in 0..8 on one line through the tree's price) one request drafts the whole
    tree at every step."""
    dear = tree_engine(3.0, tree_chain_k=3)
    ones = [dear.step(1) for _ in range(200)]
    assert ones[:9] == [TREE] * 3 + [3] * 3 + [0] * 3, ones[:9]
    assert sum(1 <= k <= 3 for k in ones[-100:]) > 80 and not set(ones) - {0, 1, 2, 3, TREE}, ones
    sixteens = [dear.step(16) for _ in range(200)]
    assert sum(k == 0 for k in sixteens[-100:]) > 80, sixteens
    cheap = tree_engine(1.8, tree_chain_k=3)
    assert sum(k == TREE for k in [cheap.step(1) for _ in range(200)][-100:]) > 80
    one_line = tree_engine(3.0)
    assert sum(k == TREE for k in [one_line.step(1) for _ in range(200)][-100:]) > 80


def test_a_tree_engine_probes_the_rungs_it_did_not_choose_in_turn():
    """Settled on a chain, the tree engine's probes alternate between the whole tree and K = 0."""
    engine = tree_engine(3.0, tree_chain_k=3, probe_every=4, max_probe_every=4)
    ks = [engine.step(1) for _ in range(400)]
    probes = [k for i, k in enumerate(ks[9:]) if k in (0, TREE) and (i == 0 or ks[9 + i - 1] != k)]
    assert TREE in probes and 0 in probes, probes


def test_max_k_must_be_positive():
    with pytest.raises(ValueError, match="max_k"):
        AdaptiveK(0)
    with pytest.raises(ValueError, match="tree_chain_k"):
        AdaptiveK(4, tree_chain_k=4)
