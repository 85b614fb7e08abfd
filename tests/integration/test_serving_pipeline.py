"""Pipelined rounds (serving/pipeline.py, protocol.VerifyRequest.after) over real HTTP on
127.0.0.1: the client sends a chain's next round before its verdict; the server verifies it right
after the round it follows, or refuses it (409) without running anything. Greedy output stays
exact; a pipelined round that arrives first waits for its round; bounds on waiting requests;
sampling through a pipelined round keeps the target's distribution (chi-square)."""

import json
import threading
import time

import httpx
import pytest
import torch
from sampling_stats import chi_square_p, code_seed, top_buckets
from serving_utils import running_server
from tiny_models import make_target

from vllm_moa.decoding.chain import plain_greedy_generate
from vllm_moa.serving.backend import Superseded
from vllm_moa.serving.client import RemoteDraftingClient, Transcript
from vllm_moa.serving.netsim import LinkConditions, NetSim
from vllm_moa.serving.protocol import DraftTreeIn, OpenRequest, ServerLimits, VerifyRequest


@pytest.fixture(scope="module")
def demo():
    """The shipped demo target and its trained MoA drafter (real acceptance: chains accepted whole)."""
    from transformers import AutoTokenizer

    from vllm_moa.models import load_drafter
    from vllm_moa.shipped import SHIPPED
    from vllm_moa.target import TargetModel

    target = TargetModel.from_pretrained(SHIPPED / "target")
    target.name = json.loads((SHIPPED / "moa-tli0" / "config.json").read_text())["target"]["name"]
    drafter = load_drafter(SHIPPED / "moa-tli0", target).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED / "target"))
    texts = [p["text"] for p in json.loads((SHIPPED / "heldout_prompts.json").read_text())][:4]
    prompts = [tokenizer(t)["input_ids"][-48:] for t in texts]
    return target, drafter, prompts


def test_pipelined_rounds_are_verified_in_order_and_keep_greedy_output(demo):
    """With rounds in flight (over a 20 ms link) the output is the target's greedy output, event
    for event; pipelined rounds are verified (not merely sent), the others refused by the server
    without running, and none is mistaken for a stale session (no reopen)."""
    target, drafter, prompts = demo
    totals = {"sent": 0, "verified": 0, "reopens": 0, "calls": [0, 0]}
    with running_server(target, {"moa-tli0": drafter}) as (url, app, backend):
        with NetSim(int(url.rsplit(":", 1)[1]), LinkConditions(rtt_ms=20.0), seed=3) as sim:
            for ids in prompts:
                expected = plain_greedy_generate(target, ids, 48).token_ids
                for pipeline in (1, 2):
                    with RemoteDraftingClient(sim.url, drafter, target, pipeline=pipeline, num_draft=3) as client:
                        view = Transcript()
                        result = client.generate(ids, 48, on_event=view.apply)
                    assert result.token_ids == expected == view.tokens, (pipeline, ids)
                    assert result.num_verified == 48 and result.rollbacks == 0
                    totals["calls"][pipeline - 1] += result.verify_calls
                    if pipeline == 1:
                        assert result.pipelined_rounds == 0
                    else:
                        totals["sent"] += result.pipelined_rounds
                        totals["verified"] += result.pipelined_verified
                        totals["reopens"] += result.reopens
    print("pipelined", totals, "superseded", backend.counters["superseded"])
    assert totals["reopens"] == 0, totals
    assert totals["sent"] > totals["verified"] > 0, totals
    assert backend.counters["superseded"] > 0  # the others were refused by the server, not run


@pytest.fixture(scope="module")
def tiny():
    target = make_target("qwen2", seed=5)
    limits = ServerLimits(max_rounds_in_flight=2, round_wait_s=0.5)
    with running_server(target, {}, limits) as (url, app, backend):
        yield target, url, backend


def _open(http, prompt):
    opened = http.post("/v1/sessions", json={"prompt": prompt, "drafter": {"kind": "ngram"}}).json()
    return opened["session_id"], opened["length"], opened["first_token"]


def _round(seq, tokens, number, after=None):
    return {"seq": seq, "tree": {"tokens": tokens, "parents": list(range(-1, len(tokens) - 1))}, "round": number,
            "after": after}


def test_a_pipelined_round_waits_for_its_round_or_is_refused(tiny):
    target, url, backend = tiny
    prompt = [3, 1, 4, 1, 5]
    greedy = plain_greedy_generate(target, prompt, 12).token_ids  # greedy[0] is the session's first token
    with httpx.Client(base_url=url, timeout=10) as http:
        sid, seq, first = _open(http, prompt)
        assert first == greedy[0]
        verify = f"/v1/sessions/{sid}/verify"
        # round 2 goes out first; it waits for round 1 and is verified right after it
        answers = {}
        later = threading.Thread(target=lambda: answers.update(
            r2=http.post(verify, json=_round(seq + 4, greedy[4:7], 2, after=1))))
        later.start()
        time.sleep(0.2)
        r1 = http.post(verify, json=_round(seq, greedy[:4], 1))
        later.join()
        assert r1.status_code == 200 and r1.json()["accepted"] == greedy[1:4] and r1.json()["next_token"] == greedy[4]
        r2 = answers["r2"]
        assert r2.status_code == 200, r2.text
        assert r2.json()["accepted"] == greedy[5:7] and r2.json()["seq"] == seq + 7
        # a pipelined round drafted from a wrong guess of the next token: refused, nothing run
        verifies = backend.counters["verifies"]
        r3 = http.post(verify, json=_round(seq + 7, greedy[7:10], 3))
        assert r3.status_code == 200 and r3.json()["seq"] == seq + 10
        wrong = (greedy[10] + 1) % target.vocab_size
        r4 = http.post(verify, json=_round(seq + 10, [wrong, greedy[11]], 4, after=3))
        assert r4.status_code == 409 and "not verified" in r4.json()["error"]
        assert backend.counters["verifies"] == verifies + 1  # only round 3 ran
        # so is one behind a round that ended short, and one whose round never comes (round_wait_s)
        short = http.post(verify, json=_round(seq + 10, [greedy[10], wrong], 5))
        assert short.status_code == 200 and short.json()["seq"] == seq + 11
        behind = http.post(verify, json=_round(seq + 12, [greedy[12 - 1]], 6, after=5))
        assert behind.status_code == 409 and "not verified" in behind.json()["error"]
        started = time.monotonic()
        never = http.post(verify, json=_round(seq + 11, [greedy[11]], 9, after=8))
        assert never.status_code == 409 and "never came" in never.json()["error"]
        assert time.monotonic() - started >= 0.5
        # the session is intact: the next round from where round 5 left it
        assert http.post(verify, json=_round(seq + 11, [greedy[11]], 10)).status_code == 200
        # bad pipelining input gets a clear 4xx
        bad = http.post(verify, json={**_round(seq + 12, [1], 11), "round": None, "after": 10})
        assert bad.status_code == 422 and "round > after" in bad.json()["error"]


def test_waiting_rounds_per_session_are_bounded(tiny):
    target, url, backend = tiny
    with httpx.Client(base_url=url, timeout=10) as http:
        sid, seq, first = _open(http, [7, 7, 7])
        verify = f"/v1/sessions/{sid}/verify"
        answers = []
        waiting = [threading.Thread(target=lambda n=n: answers.append(
            http.post(verify, json=_round(seq + 5 + n, [1], 20 + n, after=19)).status_code)) for n in range(2)]
        for thread in waiting:
            thread.start()
        time.sleep(0.15)
        third = http.post(verify, json=_round(seq + 9, [1], 30, after=19))
        assert third.status_code == 429 and "max_rounds_in_flight" in third.json()["error"]
        for thread in waiting:
            thread.join()
        assert answers == [409, 409]  # round 19 never came


def test_sampling_through_a_pipelined_round_keeps_the_targets_distribution():
    """Temperature 0.5: round 1 runs the root alone, round 2 (pipelined) is drafted from the greedy
    guess of round 1's next token. When round 2 runs, the token it gives for the position after its
    root is distributed as the target's next-token distribution there (chi-square over the trials
    where round 2 ran); every other trial's round 2 was refused, never run."""
    from vllm_moa.serving.backend import TransformersBackend

    target = make_target("llama", seed=4, vocab_size=8)  # few tokens: every bucket well filled
    backend = TransformersBackend(target, {})
    prompt = [1, 2, 3]
    greedy = plain_greedy_generate(target, prompt, 4).token_ids
    with torch.no_grad():
        logits = target.hf_model(torch.tensor([prompt + greedy[:2]])).logits[0, -1].float()
    probs = torch.softmax(logits / 0.5, -1)
    first = code_seed("vllm_moa/serving", "vllm_moa/decoding")
    tokens, refused, trials = [], 0, 0
    for seed in range(first, first + 4000):
        session, opened = backend.open(OpenRequest.model_validate(
            {"prompt": prompt, "pending": greedy[0], "drafter": {"kind": "ngram"},
             "sampling": {"temperature": 0.5, "seed": seed}}))
        seq = len(prompt)
        backend.verify(session, VerifyRequest(seq=seq, round=1, tree=DraftTreeIn(tokens=greedy[:1], parents=[-1])))
        try:
            r2 = backend.verify(session, VerifyRequest(seq=seq + 1, round=2, after=1,
                                                       tree=DraftTreeIn(tokens=greedy[1:3], parents=[-1, 0])))
            tokens.append(r2.accepted[0] if r2.accepted else r2.next_token)
        except Superseded:
            refused += 1
        backend.close(session)
        trials += 1
        if len(tokens) >= 600:
            break
    observed, expected = top_buckets(tokens, probs)
    p = chi_square_p(observed, expected)
    print("pipelined sampling: seeds from", first, "p =", p, "ran", len(tokens), "refused", refused)
    assert refused > 0 and len(tokens) >= 600, (refused, len(tokens), trials)
    assert p > 1e-3, (first, observed, expected)


def test_a_client_that_asks_for_more_rounds_in_flight_than_the_server_holds_stays_exact(demo):
    """--pipeline 8 against a server that lets one round wait per session (max_rounds_in_flight=1):
    the client sends no more than the server holds (and would stop pipelining on a 429), so the
    generation completes, exact, with rounds pipelined."""
    target, drafter, prompts = demo
    limits = ServerLimits(max_rounds_in_flight=1)
    with running_server(target, {"moa-tli0": drafter}, limits) as (url, app, backend):
        with NetSim(int(url.rsplit(":", 1)[1]), LinkConditions(rtt_ms=20.0), seed=4) as sim:
            with RemoteDraftingClient(sim.url, drafter, target, pipeline=8, num_draft=3) as client:
                for ids in prompts[:2]:
                    result = client.generate(ids, 48)
                    assert result.token_ids == plain_greedy_generate(target, ids, 48).token_ids
                    assert result.pipelined_rounds > 0
