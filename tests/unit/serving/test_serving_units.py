"""Client-server pieces without a network: payload encoding, request validation, the session
table, the draft-depth controller, the server's verification semantics (TransformersBackend) and
the client's drafter sessions fed by payloads."""

import pytest
import torch
from pydantic import ValidationError
from serving_utils import tiny_drafters
from tiny_models import make_target

from vllm_moa.decoding.chain import plain_greedy_generate, speculative_greedy_generate
from vllm_moa.decoding.tree import DraftSpec
from vllm_moa.serving.adaptive import DraftController
from vllm_moa.serving.backend import BackendError, Conflict, TransformersBackend
from vllm_moa.serving.local import decode_sync, open_local, propose
from vllm_moa.serving.payload import PayloadError, decode, encode
from vllm_moa.serving.protocol import (
    DraftTreeIn,
    OpenRequest,
    SamplingOptions,
    ServerLimits,
    VerifyRequest,
)
from vllm_moa.serving.sessions import ServerBusy, SessionNotFound, SessionStore, TooManySessions


# -- payload ------------------------------------------------------------------------------------
def test_payload_roundtrip_fp16_and_int8_error_bounds():
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)) * 3
    fp16 = decode(encode(x, "fp16"))
    assert fp16.shape == x.shape
    assert torch.allclose(fp16, x, rtol=1e-3, atol=1e-3)
    int8 = decode(encode(x, "int8"))
    rows = x.reshape(-1, 64)
    bound = rows.abs().amax(-1, keepdim=True) / 127 * 0.51 + 1e-3  # half a quantisation step (+ fp16 scale)
    assert ((int8.reshape(-1, 64) - rows).abs() <= bound).all()
    assert len(encode(x, "int8").data) < 0.6 * len(encode(x, "fp16").data)
    empty = torch.zeros(0, 8)
    assert decode(encode(empty, "int8")).shape == (0, 8) and decode(encode(empty, "fp16")).shape == (0, 8)


def test_payload_refuses_malformed_tensors():
    good = encode(torch.ones(2, 4), "fp16")
    with pytest.raises(PayloadError, match="base64"):
        decode(good.model_copy(update={"data": "not base64!"}))
    with pytest.raises(PayloadError, match="needs 20 bytes, got 16"):
        decode(good.model_copy(update={"shape": [2, 5]}))
    nan = encode(torch.tensor([[float("nan"), 1.0]]), "fp16")
    with pytest.raises(PayloadError, match="non-finite"):
        decode(nan)
    q = encode(torch.ones(2, 4), "int8")
    with pytest.raises(PayloadError, match="without scales"):
        decode(q.model_copy(update={"scale": None}))
    with pytest.raises(ValueError, match="encoding"):
        encode(torch.ones(1), "bf16")


# -- protocol -----------------------------------------------------------------------------------
def test_request_models_are_strict_and_check_tree_shape():
    VerifyRequest.model_validate({"seq": 3, "tree": {"tokens": [1, 2, 3], "parents": [-1, 0, 0]}})
    bad_trees = [
        ({"tokens": [1, 2], "parents": [-1]}, "2 tokens but 1 parents"),
        ({"tokens": [1, 2], "parents": [0, 0]}, "root"),
        ({"tokens": [1, 2, 3], "parents": [-1, 2, 0]}, "parents must come before"),
        ({"tokens": [1, -2], "parents": [-1, 0]}, "greater than or equal"),
        ({"tokens": [1, True], "parents": [-1, 0]}, "valid integer"),
        ({"tokens": [1, 2.0], "parents": [-1, 0]}, "valid integer"),
        ({"tokens": [], "parents": []}, "at least 1"),
    ]
    for tree, message in bad_trees:
        with pytest.raises(ValidationError, match=message):
            DraftTreeIn.model_validate(tree)
    with pytest.raises(ValidationError, match="Extra inputs"):
        VerifyRequest.model_validate({"seq": 1, "tree": {"tokens": [1], "parents": [-1]}, "evil": 1})
    with pytest.raises(ValidationError, match="finite"):
        SamplingOptions.model_validate({"temperature": float("nan")})
    with pytest.raises(ValidationError, match="lsa_fingerprint"):
        OpenRequest.model_validate({"prompt": [1], "drafter": {"kind": "moa", "target": {
            "architecture": "x", "num_layers": 1, "hidden_size": 1, "num_attention_heads": 1, "num_kv_heads": 1,
            "head_dim": 1, "vocab_size": 1}}})
    with pytest.raises(ValidationError, match="target signature"):
        OpenRequest.model_validate({"prompt": [1], "drafter": {"kind": "eagle"}})
    OpenRequest.model_validate({"prompt": [1], "drafter": {"kind": "ngram"}})


# -- sessions -----------------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_session_store_limits_binding_and_expiry():
    clock = FakeClock()
    store = SessionStore(ServerLimits(max_sessions=4, max_sessions_per_client=2, session_idle_ttl_s=10,
                                      session_max_age_s=100), clock)
    ids = {}
    for client in ("a", "a", "b"):
        with store.reserve(client, 1) as slot:
            ids.setdefault(client, []).append(store.add(slot, object()))
    with pytest.raises(TooManySessions, match="per-client"):
        store.reserve("a", 1)
    with store.reserve("c", 1) as slot:
        ids["c"] = [store.add(slot, object())]
    with pytest.raises(ServerBusy, match="4 open sessions"):
        store.reserve("d", 1)
    with pytest.raises(SessionNotFound):
        store.get("b", ids["a"][0])  # another client's session does not exist for b
    store.remove("a", ids["a"][0])
    with store.reserve("d", 1):  # a slot is free again
        pass
    clock.now += 9
    store.get("a", ids["a"][1])  # touching it keeps it alive
    clock.now += 9
    assert store.get("a", ids["a"][1]) is not None
    with pytest.raises(SessionNotFound, match="expired"):
        store.get("b", ids["b"][0])  # idle for 18 s > 10
    assert len(store.reap()) == 1 and len(store) == 1  # c's session expired too; a's is alive
    while clock.now - 1000 <= 100:  # kept busy, but past the maximum age at the end
        store.get("a", ids["a"][1])
        clock.now += 9
    with pytest.raises(SessionNotFound, match="expired"):
        store.get("a", ids["a"][1])


def test_a_session_is_never_idle_while_a_request_is_in_flight():
    """A verify that takes longer than the idle TTL (a slow target under load) must not get its
    session reaped under it; idle time counts from the end of the last request."""
    clock = FakeClock()
    store = SessionStore(ServerLimits(session_idle_ttl_s=10, session_max_age_s=1000), clock)
    with store.reserve("a", 4) as slot:
        sid = store.add(slot, object())
    store.get("a", sid)  # a verify begins
    clock.now += 30  # ... and takes 30 s
    assert store.reap() == [] and len(store) == 1
    store.settle(sid, 8)  # it ends: idle from now
    clock.now += 9
    assert store.reap() == [] and store.get("a", sid) is not None
    store.settle(sid, 8)
    clock.now += 11
    assert len(store.reap()) == 1 and len(store) == 0


# -- adaptive depth -----------------------------------------------------------------------------
def _feed(controller, net_s, rate_accepts, rounds=30):
    for i in range(rounds):
        depth = controller.choose()
        accepted = rate_accepts(depth, i)
        controller.observe_acceptance(depth, accepted)
        controller.observe_timing(depth, net_s + 0.004 + 0.005 * depth, 0.004, 0.005 * depth)
    return controller.choose()


def test_controller_drafts_deeper_on_slow_links_and_with_better_acceptance():
    def accepts(p):  # deterministic "acceptance with probability p": accept floor(p * depth) levels
        return lambda depth, i: min(depth, int(p / (1 - p) + 0.5)) if depth else 0

    fast = _feed(DraftController(32), 0.002, accepts(0.7))
    slow = _feed(DraftController(32), 0.200, accepts(0.7))
    assert slow > fast
    poor = _feed(DraftController(32), 0.050, accepts(0.3))
    good = _feed(DraftController(32), 0.050, accepts(0.9))
    assert good > poor
    assert DraftController(32, fixed=5).choose() == 5
    assert DraftController(32, fixed=5).choose(limit=2) == 2
    assert 1 <= DraftController(4).choose(limit=100) <= 4


# -- server-side verification ---------------------------------------------------------------------
def _decl(session):
    return session.declaration().model_dump()


def test_backend_verifies_any_tree_like_the_target_and_rewinds_or_replays():
    target = make_target("llama")
    drafters = tiny_drafters(target)
    backend = TransformersBackend(target, {"m": drafters["moa-tli1"]})
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    greedy = plain_greedy_generate(target, prompt, 24).token_ids
    local = open_local(drafters["moa-tli1"], target)
    session, opened = backend.open(OpenRequest.model_validate({"prompt": prompt, "drafter": _decl(local)}))
    assert opened.first_token == greedy[0] and opened.sync.count == len(prompt) and opened.sync.tli_keys is not None
    # a tree with the true continuation on its second branch, a wrong first branch
    wrong = (greedy[1] + 1) % target.vocab_size
    tree = {"tokens": [greedy[0], wrong, greedy[1], greedy[2], greedy[3]], "parents": [-1, 0, 0, 2, 3]}
    out = backend.verify(session, VerifyRequest.model_validate({"seq": len(prompt), "tree": tree}))
    assert out.path == [0, 2, 3, 4] and out.accepted == greedy[1:4] and out.next_token == greedy[4]
    assert out.seq == len(prompt) + 4 and out.sync.start == len(prompt) and out.sync.count == 4
    again = backend.verify(session, VerifyRequest.model_validate({"seq": len(prompt), "tree": tree}))
    assert again.replayed and again.model_copy(update={"replayed": False, "server_ms": out.server_ms}) == out
    # the client lost that answer and resyncs from the same point with another draft: rewind
    chain = {"tokens": [greedy[0], greedy[1], wrong], "parents": [-1, 0, 1]}
    rewound = backend.verify(session, VerifyRequest.model_validate({"seq": len(prompt), "tree": chain}))
    assert rewound.accepted == [greedy[1]] and rewound.next_token == greedy[2] and backend.counters["rewinds"] == 1
    seq = rewound.seq
    step = backend.verify(session, VerifyRequest.model_validate({"seq": seq, "tree": {"tokens": [greedy[2]],
                                                                                       "parents": [-1]}}))
    assert step.next_token == greedy[3]
    with pytest.raises(Conflict, match="ahead"):
        backend.verify(session, VerifyRequest.model_validate({"seq": step.seq + 1, "tree": {"tokens": [1],
                                                                                             "parents": [-1]}}))
    with pytest.raises(Conflict, match="root token"):
        backend.verify(session, VerifyRequest.model_validate({"seq": step.seq, "tree": {"tokens": [wrong],
                                                                                         "parents": [-1]}}))
    with pytest.raises(BackendError, match="vocabulary"):
        backend.verify(session, VerifyRequest.model_validate({"seq": step.seq, "tree": {
            "tokens": [greedy[3], 10_000], "parents": [-1, 0]}}))


def test_backend_refuses_other_targets_and_unknown_lsa_weights():
    target = make_target("llama")
    other = make_target("llama", seed=1)
    mine, theirs = tiny_drafters(target), tiny_drafters(other)
    backend = TransformersBackend(target, {"m": mine["moa-tli0"]})
    with pytest.raises(Conflict, match="fingerprint"):
        backend.open(OpenRequest.model_validate({"prompt": [1, 2],
                                                 "drafter": _decl(open_local(theirs["eagle"], other))}))
    torch.manual_seed(5)
    stranger = tiny_drafters(target, seed=5)["moa-tli0"]  # same target, LSA weights the server lacks
    with pytest.raises(Conflict, match="no MoA drafter with LSA weights"):
        backend.open(OpenRequest.model_validate({"prompt": [1, 2], "drafter": _decl(open_local(stranger, target))}))


# -- client-side drafter sessions -----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["moa-tli0", "moa-tli1", "eagle", "independent"])
def test_payload_fed_sessions_draft_like_local_ones(kind):
    """Fed by the server's payload (fp16), a client session accepts round for round what the
    runtime's local session (fp32 target K/V) accepts, and its offline drafting equals its own chain
    proposal (two code paths, one computation)."""
    target = make_target("qwen2")
    drafter = tiny_drafters(target)[kind]
    backend = TransformersBackend(target, {"m": drafter} if kind.startswith("moa") else {})
    prompt = [7, 8, 9, 10, 11, 12]
    local = open_local(drafter, target)
    session, opened = backend.open(OpenRequest.model_validate({"prompt": prompt, "drafter": _decl(local)}))
    local.start(prompt, decode_sync(opened.sync, torch.float32, target.device))
    pending, seq, produced, accepted = opened.first_token, opened.length, [opened.first_token], []
    reference = speculative_greedy_generate(target, drafter, prompt, 20, num_draft=3)
    for _ in range(6):
        # offline drafting from the verified state equals the chain proposal (two code paths)
        ahead = local.draft_ahead([pending], 3)
        tree = propose(local, pending, DraftSpec.chain(3))
        assert tree.tokens.tolist()[1:] == ahead
        out = backend.verify(session, VerifyRequest.model_validate(
            {"seq": seq, "tree": {"tokens": tree.tokens.tolist(), "parents": tree.parents}}))
        local.accept(tree, out.path, decode_sync(out.sync, torch.float32, target.device))
        pending, seq = out.next_token, out.seq
        produced += out.accepted + [out.next_token]
        accepted.append(len(out.path))
    assert produced[:20] == reference.token_ids[: len(produced[:20])]
    assert accepted == reference.accepted_per_forward[: len(accepted)]


def test_server_sampling_is_lossless_for_point_mass_and_offline_drafts():
    """Sampling through the server: the client proposes deterministic drafts, or tokens it drew from
    its own drafter while offline; the server verifies both as point masses (sampled_accept with no
    q). The two tokens after the prompt must follow the target's own sampling distribution
    (chi-square against the exact one, enumerated)."""
    import itertools

    from scipy.stats import chisquare

    vocab, samples = 4, 2_400
    target = make_target("llama", vocab_size=vocab)
    backend = TransformersBackend(target)
    prompt = [1, 3, 0, 2]
    exact = {}
    with torch.no_grad():
        for a, b in itertools.product(range(vocab), repeat=2):
            p = torch.softmax(target(torch.tensor([prompt + [a]])).logits[0, -2:].float(), -1)
            exact[(a, b)] = float(p[0, a] * p[1, b])
    drafts = torch.Generator().manual_seed(0)
    counts = {}
    for seed in range(samples):
        session, opened = backend.open(OpenRequest.model_validate(
            {"prompt": prompt, "drafter": {"kind": "ngram"}, "sampling": {"temperature": 1.0, "seed": seed}}))
        first = opened.first_token
        # half the rounds: a fixed draft (always token 2); half: a token "drafted offline" from a skewed q
        guess = 2 if seed % 2 else int(torch.multinomial(torch.tensor([0.7, 0.1, 0.1, 0.1]), 1, generator=drafts))
        out = backend.verify(session, VerifyRequest.model_validate(
            {"seq": len(prompt), "tree": {"tokens": [first, guess], "parents": [-1, 0]}}))
        second = out.accepted[0] if out.accepted else out.next_token
        counts[(first, second)] = counts.get((first, second), 0) + 1
        backend.close(session)
    cells = sorted(exact, key=exact.get)
    small = [c for c in cells if exact[c] * samples < 5]  # pooled: chi-square needs expected counts >= 5
    observed = [counts.get(c, 0) for c in cells if c not in small]
    expected = [exact[c] for c in cells if c not in small]
    if small:
        observed.append(sum(counts.get(c, 0) for c in small))
        expected.append(sum(exact[c] for c in small))
    expected = [e * samples / sum(expected) for e in expected]  # sums to `samples` exactly, not to 1e-8
    assert chisquare(observed, expected).pvalue > 1e-3, (observed, [round(e) for e in expected])


def test_a_sampling_tests_seed_is_drawn_afresh_when_the_code_under_test_changes(tmp_path, monkeypatch):
    """tests/sampling_stats.code_seed: the same bytes give the same seed; a changed byte, or a file
    added, another."""
    from tests import sampling_stats

    code = tmp_path / "pkg"
    code.mkdir()
    (code / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(sampling_stats, "REPO", tmp_path)
    first = sampling_stats.code_seed("pkg")
    assert sampling_stats.code_seed("pkg") == first
    (code / "a.py").write_text("x = 2\n")
    second = sampling_stats.code_seed("pkg")
    (code / "b.py").write_text("")
    assert len({first, second, sampling_stats.code_seed("pkg")}) == 3


def test_the_users_benchmark_accepts_a_float32_near_tie_and_nothing_else():
    """benchmarks/client_server_users.near_tie_gap: an output that parts from the greedy one where
    the target's logits hold the chosen token within 1e-4 of the top is a near-tie (its position
    and gap); anywhere else, or by more, it is a difference."""
    from types import SimpleNamespace

    import torch

    from benchmarks.client_server_users import near_tie_gap

    def target(gap_at_3: float):
        def hf_model(ids):
            logits = torch.zeros(1, ids.shape[1], 10)
            logits[0, -1, 1] = 5.0
            if ids.shape[1] == 3:  # the prefix of position 1: token 2 within gap_at_3 of token 1
                logits[0, -1, 2] = 5.0 - gap_at_3
            return SimpleNamespace(logits=logits)
        return SimpleNamespace(hf_model=hf_model)

    prompt, want = [7, 7], [1, 1, 1, 1]
    assert near_tie_gap(target(5e-5), prompt, want, want) is None
    position, gap = near_tie_gap(target(5e-5), prompt, [1, 2, 3, 3], want)
    assert position == 1 and gap == pytest.approx(5e-5, rel=1e-2)
    assert near_tie_gap(target(0.5), prompt, [1, 2, 3, 3], want) is None
    assert near_tie_gap(target(5e-5), prompt, [1, 1, 2, 3], want) is None  # the tie is not where they part


def test_one_more_round_in_flight_pays_only_when_it_is_likely_and_cheap_enough():
    from vllm_moa.serving.pipeline import MIN_CHANCE, pipeline_pays

    # 0.8 ** 4 = 0.41 of a 60 ms round saved (24.6 ms) against 10 ms of drafting
    assert pipeline_pays(0.8, 4, saved_s=0.060, draft_s=0.010)
    # the same chance against 30 ms of drafting: not worth it
    assert not pipeline_pays(0.8, 4, saved_s=0.060, draft_s=0.030)
    # free (a lookup continuation), but almost surely thrown away
    assert 0.4 ** 5 < MIN_CHANCE and not pipeline_pays(0.4, 5, saved_s=1.0, draft_s=0.0)


def test_lookup_continues_past_the_chains_in_flight():
    from vllm_moa.decoding.retrieval import Retrieval
    from vllm_moa.serving.pipeline import lookup_ahead

    verified = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    # in flight: [3, 4] (the pending token and a draft): lookup finds 1 2 3 4 earlier, then 5 6 7 8
    assert lookup_ahead(Retrieval(), verified, [3, 4], 3) == [5, 6, 7]
    assert lookup_ahead(Retrieval(), verified, [30, 40], 3) == []  # no match
    assert lookup_ahead(None, verified, [3, 4], 3) == []  # lookup off


def test_a_pipelined_round_must_name_its_own_later_number():
    tree = {"tokens": [1], "parents": [-1]}
    VerifyRequest.model_validate({"seq": 3, "tree": tree, "round": 5, "after": 4})
    for bad in ({"after": 4}, {"round": 4, "after": 4}, {"round": 3, "after": 4}):
        with pytest.raises(ValidationError, match="round > after"):
            VerifyRequest.model_validate({"seq": 3, "tree": tree, **bad})
