"""The speculative engine: greedy exactness for every drafter, chain and tree, batch 1 and 4;
caches after each round equal a fresh computation over the accepted prefix; bad requests are
refused before any work."""

import random

import pytest
import torch
from tiny_models import make_target, oracle_sessions

from vllm_moa.decoding import engine as engine_module
from vllm_moa.decoding import target_slices
from vllm_moa.decoding.chain import plain_greedy_generate
from vllm_moa.decoding.engine import SpeculativeEngine
from vllm_moa.decoding.retrieval import Retrieval
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.decoding.tree import DraftSpec, DraftTree, grow_tree
from vllm_moa.kinds.eagle import EagleDrafter, EagleDrafterConfig, EagleSession
from vllm_moa.kinds.independent import IndependentDrafter, IndependentDrafterConfig, IndependentSession
from vllm_moa.kinds.moa import MoAConfig, MoADrafter, MoASession

SPECS = {"chain": DraftSpec.chain(3), "tree": DraftSpec.tree(depth=3, top_k=3, budget=8)}
KINDS = ["moa-tli0", "moa-tli1", "eagle", "independent", "ngram"]
NEW_TOKENS = 20


def make_drafter(kind, target):
    torch.manual_seed(0)
    sig = target.signature
    if kind.startswith("moa"):
        return MoADrafter(MoAConfig(target=sig, tli=int(kind[-1]))).eval()
    if kind == "eagle":
        return EagleDrafter(EagleDrafterConfig(target=sig)).eval()
    if kind == "independent":
        return IndependentDrafter(IndependentDrafterConfig(target=sig)).eval()
    return kind


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(97) for _ in range(rng.randint(1, 14))] for _ in range(20)]


@pytest.fixture(scope="module")
def greedy(target, prompts):
    return [plain_greedy_generate(target, p, NEW_TOKENS).token_ids for p in prompts]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_output_equals_target_greedy(target, prompts, greedy, kind, shape, batch):
    engine = SpeculativeEngine(target, make_drafter(kind, target), SPECS[shape])
    outputs = []
    for i in range(0, len(prompts), batch):
        outputs += engine.generate(prompts[i : i + batch], NEW_TOKENS)
    assert [o.token_ids for o in outputs] == greedy
    for o in outputs:
        assert o.finish_reason == "length" and o.target_forwards == len(o.accepted_per_forward)


def _fresh_session(kind, drafter, target, prefix):
    session = MoASession(drafter, target) if kind.startswith("moa") else \
        EagleSession(drafter, target) if kind == "eagle" else IndependentSession(drafter)
    ids = torch.tensor([prefix])
    session.start(ids, target(ids))
    return session


def _assert_same_caches(kind, session, fresh):
    close = dict(atol=2e-5, rtol=1e-4)
    if kind.startswith("moa"):
        a, b = session.state, fresh.state
        assert a.num_verified == b.num_verified and a.sa_length == b.sa_length
        torch.testing.assert_close(a.rows, b.rows, **close)
        torch.testing.assert_close(a.row_k, b.row_k, **close)
        torch.testing.assert_close(a.sa.k, b.sa.k, **close)
        torch.testing.assert_close(a.sa.v, b.sa.v, **close)
        for x, y in zip(a.tli_true.keys + a.tli_true.values, b.tli_true.keys + b.tli_true.values):
            torch.testing.assert_close(x, y, **close)
    elif kind == "eagle":
        torch.testing.assert_close(session.cache.k, fresh.cache.k, **close)
        torch.testing.assert_close(session.cache.v, fresh.cache.v, **close)
        torch.testing.assert_close(session.last_feature, fresh.last_feature, **close)
    else:
        for x, y in zip(session.caches, fresh.caches):
            torch.testing.assert_close(x.k, y.k, **close)
            torch.testing.assert_close(x.v, y.v, **close)


@pytest.mark.parametrize("kind", ["moa-tli0", "moa-tli1", "eagle", "independent"])
def test_caches_after_each_round_equal_a_fresh_computation(target, prompts, greedy, kind, monkeypatch):
    """Deep acceptance through random branches of trees (oracle drafters), batch 4: after every
    round the target's cache equals a recomputation over the accepted prefix, and the drafter's
    caches equal a fresh session started on that prefix; the output is still exact."""
    drafter = make_drafter(kind, target)
    batch_prompts, batch_greedy = prompts[:4], greedy[:4]
    sessions = iter(oracle_sessions(kind, drafter, target, batch_prompts, batch_greedy))
    monkeypatch.setattr(engine_module.kinds, "open_runtime_session", lambda _drafter, _target: next(sessions))
    engine = SpeculativeEngine(target, drafter, DraftSpec.tree(depth=4, top_k=3, budget=10))
    batch = engine.start(batch_prompts, [NEW_TOKENS] * 4)
    rounds = 0
    while True:
        for row, seq in enumerate(batch.active):
            prefix = seq.prompt + seq.tokens[:-1]  # the last token is pending: not yet in any cache
            keys, values = batch.cache.sequence(row)
            recomputed = target(torch.tensor([prefix]))
            for k, k_ref, v, v_ref in zip(keys, recomputed.keys, values, recomputed.values):
                torch.testing.assert_close(k, k_ref, atol=2e-5, rtol=1e-4)
                torch.testing.assert_close(v, v_ref, atol=2e-5, rtol=1e-4)
            _assert_same_caches(kind, seq.session, _fresh_session(kind, drafter, target, prefix))
        if not batch.step():
            break
        rounds += 1
    results = batch.results
    assert [r.token_ids for r in results] == batch_greedy
    # the oracle made trees accept deep paths, so compaction really ran on non-trivial paths
    assert sum(r.acceptance_length for r in results) / 4 > 2.0


def test_tree_growth_follows_eagle2():
    """EAGLE-2 growth on a fixed table of logits, against an independent re-derivation: each level
    expands the top_k best nodes by path log-probability, each proposing its top_k children; the
    budget keeps the best nodes overall; parents come first; every fed node sees its ancestors."""
    torch.manual_seed(0)
    table = torch.randn(50, 50)
    logp = torch.log_softmax(table, -1)
    fed = []

    def step(tokens, depths, parent_slots, visible):
        fed.append((tokens.tolist(), visible.clone()))
        return table[tokens]

    tree = grow_tree(step, 7, DraftSpec.tree(depth=3, top_k=2, budget=5), None, None, torch.device("cpu"))
    # re-derivation: candidates are paths (tuples of tokens after the root) with their scores
    frontier, candidates = [((), 0.0)], []
    for _ in range(3):
        level = []
        for path, score in frontier:
            last = path[-1] if path else 7
            for token in logp[last].topk(2).indices.tolist():
                level.append((path + (token,), score + float(logp[last, token])))
        candidates += level
        frontier = sorted(level, key=lambda c: -c[1])[:2]
    best = {path for path, _ in sorted(candidates, key=lambda c: -c[1])[:5]}
    got = {tuple(tree.tokens[tree.path_to(i)].tolist()[1:]) for i in range(1, tree.size)}
    assert got == best
    assert tree.size == 6 and all(tree.parents[i] < i for i in range(1, 6))
    assert [len(tokens) for tokens, _ in fed] == [1, 2, 2]  # root, then the top_k frontier per level
    assert fed[0][1].tolist() == [[True]]
    # level 2: both nodes are children of the root (slot 0): they see it and themselves only
    assert fed[1][1].tolist() == [[True, True, False], [True, False, True]]


def test_draft_spec_and_tree_validation():
    with pytest.raises(ValueError, match="budget"):
        DraftSpec(depth=2, top_k=2, budget=100)
    with pytest.raises(ValueError, match="depth"):
        DraftSpec.chain(0)
    with pytest.raises(ValueError, match="top_k"):
        DraftSpec(depth=2, top_k=0)
    chain = DraftTree.chain(5, [6, 7])
    assert chain.ancestor_mask().tolist() == [[True, False, False], [True, True, False], [True, True, True]]


@pytest.mark.parametrize("call,match", [
    (dict(prompts=[[]]), "prompt 0 is empty"),
    (dict(prompts=[[1, 2], [1] * 300]), "prompt 1 has 300 tokens: longer than the target's context window"),
    (dict(prompts=[[1, 200]]), "outside the target's vocabulary"),
    (dict(prompts=[[1]], max_tokens=0), "max_tokens"),
    (dict(prompts=[[1]], max_tokens=[4, 4]), "max_tokens has 2 entries"),
    (dict(prompts=[[1] * 200], max_tokens=100), "exceeds the context window"),
    (dict(prompts=[[1]], stop=["x"]), "stop strings need a tokenizer"),
    (dict(prompts=[]), "prompts is empty"),
])
def test_bad_requests_are_refused_before_any_work(target, call, match):
    engine = SpeculativeEngine(target, "ngram", DraftSpec.chain(3))
    with pytest.raises(ValueError, match=match):
        engine.generate(**{"max_tokens": 8, **call})


def test_tree_budget_larger_than_the_context_is_refused(target):
    engine = SpeculativeEngine(target, "ngram", DraftSpec.tree(depth=8, top_k=8, budget=300))
    with pytest.raises(ValueError, match="tree budget 300"):
        engine.generate([[1, 2, 3]], 4)


def test_invalid_sampling_parameters_are_refused(target):
    with pytest.raises(ValueError, match="temperature"):
        SpeculativeEngine(target, "ngram").generate([[1]], 4, SamplingParams(temperature=float("nan")))


def test_streaming_stops_and_metrics(target, prompts, greedy):
    """Per-sequence stops in one batch: EOS for one request, max_tokens for the others; the stream
    adds up to each result."""
    eos = greedy[1][5]
    streamed = {i: [] for i in range(3)}
    engine = SpeculativeEngine(target, make_drafter("moa-tli1", target), DraftSpec.tree(depth=3, top_k=2, budget=5))
    outs = engine.generate(prompts[:3], [NEW_TOKENS, NEW_TOKENS, 7], eos_token_id=eos,
                           on_tokens=lambda i, toks: streamed[i].extend(toks))
    for i, out in enumerate(outs):
        assert streamed[i] == out.token_ids
        expected = plain_greedy_generate(target, prompts[i], [NEW_TOKENS, NEW_TOKENS, 7][i], eos_token_id=eos).token_ids
        assert out.token_ids == expected
        assert out.finish_reason == ("eos" if eos in out.token_ids else "length")
        assert 0 < out.ttft <= out.seconds and 0 <= out.drafter_share <= 1
        assert out.acceptance_length >= 1 and len(out.acceptance_by_position(3)) == 3
    assert outs[1].finish_reason == "eos"


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("kind", ["moa-tli0", "eagle", "ngram"])
def test_adaptive_rounds_keep_greedy_output(target, prompts, greedy, kind, shape):
    """Acceptance estimated near 0 after the first round: plain rounds (the drafter catches up on
    the accepted token) with a speculative probe now and then; every output is the target's."""
    engine = SpeculativeEngine(target, make_drafter(kind, target), SPECS[shape], adaptive=True)
    outputs, depths = [], []
    for i in range(0, 12, 4):
        batch = engine.start(prompts[i: i + 4], [NEW_TOKENS] * 4)
        batch.controller.acceptance.successes = 0.0  # as if nothing was ever accepted
        batch.controller.probe_every = 4
        while batch.step():
            pass
        outputs += batch.results
        depths += [d for r in batch.results for d in r.drafted_per_forward]
    assert [r.token_ids for r in outputs] == greedy[:12]
    assert 0 in depths and any(d > 0 for d in depths), depths


def _price_plain_rounds_best(controller, batch: int) -> None:
    """Measurements after which plain rounds pay best at `batch` sequences whatever this machine
    timed (on a loaded machine a drafting round of these tiny models can time faster than a plain
    one, and the verdict the tests start from flipped): plain rounds at 1 ms, rounds of every
    depth at 10 ms plus 10 ms of drafting, none of their drafts accepted."""
    for _ in range(30):
        controller.observe(batch, 0, 0.001, 0.0, [])
        for depth in controller.depths:
            controller.observe(batch, depth, 0.01, 0.01, [0] * batch)


@pytest.mark.parametrize("kind", ["moa-tli0", "eagle", "independent"])
def test_sessions_start_when_drafting_resumes(target, prompts, greedy, kind):
    """The engine keeps its controller across calls: once plain rounds pay best at a batch size,
    the next call at that size starts no drafting session at prefill. A probe later starts them
    and catches them up in one go: right after, their caches equal a fresh session's."""
    drafter = make_drafter(kind, target)
    engine = SpeculativeEngine(target, drafter, SPECS["chain"], adaptive=True)
    first = engine.start(prompts[:4], [NEW_TOKENS] * 4)
    engine.controller.acceptance.successes = 0.0  # as if nothing was ever accepted
    while first.step():
        pass
    _price_plain_rounds_best(engine.controller, 4)
    assert engine.controller.prefers_plain(4)
    engine.controller.probe_every, engine.controller.plain_streak, engine.controller.probe_cost = 6, 0, 0.0
    batch = engine.start(prompts[4:8], [NEW_TOKENS] * 4)
    assert all(s.unstarted is not None and s.result.drafter_seconds == 0 for s in batch.sequences)
    started = 0
    while batch.step():
        for seq in batch.active:
            drafted = seq.result.drafted_per_forward
            if drafted[-1] > 0 and not any(drafted[:-1]):  # the first drafted round: just started
                assert seq.unstarted is None and seq.result.drafter_seconds > 0
                _assert_same_caches(kind, seq.session, _fresh_session(kind, drafter, target, seq.prompt + seq.tokens[:-1]))
                started += 1
    assert started > 0
    assert [r.token_ids for r in first.results + batch.results] == greedy[:8]


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_long_backlog_restarts_the_session_from_its_last_tokens(target, prompts, greedy, hybrid):
    """Drafting resumes after more plain-decoded tokens than catch_up_window: a fresh session
    starts from the target's outputs over the last `window` tokens only (lookup still reads the
    whole history). Right after, its caches equal a session started from the same outputs of the
    whole prefix, cut to its last tokens; TLI > 0 refuses such a start; outputs stay the target's."""
    window = 5
    drafter = make_drafter("moa-tli0", target)
    engine = SpeculativeEngine(target, drafter, SPECS["chain"], adaptive=True, catch_up_window=window,
                               retrieval=Retrieval() if hybrid else None)
    first = engine.start(prompts[:4], [NEW_TOKENS] * 4)
    engine.controller.acceptance.successes = 0.0
    while first.step():
        pass
    _price_plain_rounds_best(engine.controller, 4)
    engine.controller.probe_every, engine.controller.plain_streak, engine.controller.probe_cost = 6, 0, 0.0
    batch = engine.start(prompts[4:8], [NEW_TOKENS] * 4)
    restarted = 0
    while batch.step():
        for seq in batch.active:
            drafted = seq.result.drafted_per_forward
            if drafted[-1] > 0 and not any(drafted[:-1]):  # the first drafted round: just restarted
                prefix = seq.prompt + seq.tokens[:-1]
                session = seq.session.model if hybrid else seq.session
                if hybrid:
                    assert seq.session.history == prefix  # lookup reads everything
                ids = torch.tensor([prefix])
                fresh = MoASession(drafter, target)
                fresh.start(ids, target_slices.last_tokens(target(ids), window + seq.result.accepted_per_forward[-1]))
                _assert_same_caches("moa-tli0", session, fresh)
                restarted += 1
    assert restarted > 0
    assert [r.token_ids for r in first.results + batch.results] == greedy[:8]
    ids = torch.tensor([prompts[0]])
    with pytest.raises(ValueError, match="TLI=1 MoA session starts from the whole prompt"):
        MoASession(make_drafter("moa-tli1", target), target).start(ids, target_slices.last_tokens(target(ids), 2))


@pytest.mark.parametrize("kind", ["moa-tli0", "moa-tli1", "eagle", "independent"])
def test_adaptive_drafter_catches_up_to_a_fresh_computation(target, prompts, greedy, kind):
    """Plain rounds leave the drafter behind; the next speculative round first runs it over those
    tokens in one call: right after it, its caches equal a fresh session's on the sequence so far."""
    drafter = make_drafter(kind, target)
    engine = SpeculativeEngine(target, drafter, SPECS["chain"], adaptive=True)
    batch = engine.start(prompts[:4], [NEW_TOKENS] * 4)
    batch.controller.acceptance.successes = 0.0
    batch.controller.probe_every = 4
    caught_up = 0
    while batch.step():
        for seq in batch.active:
            if seq.result.drafted_per_forward[-1] > 0 and seq.result.drafted_per_forward[-2:-1] == [0]:
                prefix = seq.prompt + seq.tokens[:-1]
                _assert_same_caches(kind, seq.session, _fresh_session(kind, drafter, target, prefix))
                caught_up += 1
    assert caught_up > 0
    assert [r.token_ids for r in batch.results] == greedy[:4]


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_requests_repeating_a_prompt_share_its_prefill_and_decode_as_alone(target, prompts, greedy, shape,
                                                                         monkeypatch):
    """n samples of one prompt: the target's prefill runs over the distinct prompts only (one row
    each), and every request still decodes exactly as it would alone (greedy), its own drafting
    session and cache row after the prefill; sampled, the repeats draw their own tokens."""
    rows = []
    forward = type(target).forward

    def counted(self, ids, *args, **kwargs):
        rows.append(ids.shape[0])
        return forward(self, ids, *args, **kwargs)

    monkeypatch.setattr(type(target), "forward", counted)
    engine = SpeculativeEngine(target, make_drafter("moa-tli0", target), SPECS[shape])
    order = [0, 1, 0, 2, 1, 0]
    results = engine.generate([prompts[i] for i in order], NEW_TOKENS)
    assert rows[0] == 3  # the prefill: 3 distinct prompts for 6 requests
    assert [r.token_ids for r in results] == [greedy[i] for i in order]
    sampled = engine.generate([prompts[0]] * 8, NEW_TOKENS, sampling=SamplingParams(temperature=1.0), seed=0)
    assert len({tuple(r.token_ids) for r in sampled}) > 1
