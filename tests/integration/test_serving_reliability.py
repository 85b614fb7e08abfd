"""What a hostile client and a careless user found (issue 14), over real HTTP on 127.0.0.1: tiny,
subnormal and huge temperatures; admission control with every worker busy (health and refusals
answer at once); the token budget and the per-sequence length limit (also for a target that
declares no context window); closing a session while its verify is in flight; auth on the
documentation routes and before the body is parsed; a client that refuses an inconsistent server."""

import json
import threading

import httpx
import pytest
import torch
from serving_utils import GatedBackend, running_server, tiny_drafters
from tiny_models import make_target

from vllm_moa.decoding.chain import plain_greedy_generate
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.serving.backend import TransformersBackend
from vllm_moa.serving.client import ProtocolError, RemoteDraftingClient
from vllm_moa.serving.payload import encode
from vllm_moa.serving.protocol import ServerLimits
from vllm_moa.serving.security import check_exposure

TOKENS = ["client-a-token-0000", "client-b-token-1111", "client-c-token-2222"]
AUTH = [{"Authorization": f"Bearer {t}"} for t in TOKENS]
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def target():
    return make_target("llama", seed=9)


@pytest.fixture(scope="module")
def greedy(target):
    return plain_greedy_generate(target, PROMPT, 12).token_ids


def _post(url, path, body, headers=None, **kwargs):
    # json.dumps writes inf / nan as the tokens Infinity / NaN, which the server's parser accepts
    return httpx.post(f"{url}{path}", content=json.dumps(body), timeout=kwargs.pop("timeout", 60),
                      headers={"content-type": "application/json", **(headers or {})}, **kwargs)


def _ngram_open(prompt, temperature=0.0):
    return {"prompt": prompt, "drafter": {"kind": "ngram"}, "sampling": {"temperature": temperature}}


# -- 1. temperatures ----------------------------------------------------------------------------------
def test_tiny_temperatures_are_greedy_and_out_of_range_ones_are_refused(target, greedy):
    with running_server(target, {}) as (url, app, backend):
        for temperature in (5e-324, 1e-310, 1e-40, 9e-6):
            body = {"prompt": PROMPT, "max_tokens": 12, "sampling": {"temperature": temperature, "seed": 1}}
            r = _post(url, "/v1/generate", body)
            assert r.status_code == 200 and r.json()["tokens"] == greedy, (temperature, r.text[:300])
            r = _post(url, "/v1/generate", {**body, "stream": True})
            lines = [json.loads(line) for line in r.text.splitlines()]
            assert r.status_code == 200 and lines[-1]["done"], (temperature, r.text[-300:])
            assert [t for line in lines[:-1] for t in line["tokens"]] == greedy
            opened = _post(url, "/v1/sessions", _ngram_open(PROMPT, temperature))
            assert opened.status_code == 200 and opened.json()["first_token"] == greedy[0], opened.text[:300]
            sid, seq = opened.json()["session_id"], opened.json()["length"]
            r = _post(url, f"/v1/sessions/{sid}/verify", {"seq": seq, "tree": {"tokens": greedy[:3],
                                                                                 "parents": [-1, 0, 1]}})
            assert r.status_code == 200 and r.json()["accepted"] == greedy[1:3], r.text[:300]
        for temperature in (float("inf"), float("nan"), 1e308, 100.5, -5e-324):
            for path, body in (("/v1/generate", {"prompt": PROMPT, "max_tokens": 4,
                                                 "sampling": {"temperature": temperature}}),
                               ("/v1/sessions", _ngram_open(PROMPT, temperature))):
                r = _post(url, path, body)
                assert r.status_code == 422 and "temperature" in r.json()["error"], (temperature, r.text)
        assert backend.counters["generates"] == 8  # every refusal came before any work
    # the API-call client with a subnormal temperature: greedy, nothing retried
    with running_server(target, {}) as (url, app, backend):
        with RemoteDraftingClient(url, None, give_up_after_s=5) as client:
            result = client.generate(PROMPT, 12, SamplingParams(temperature=1e-40), seed=3)
    assert result.token_ids == greedy and result.failures == 0


# -- 2. admission: with every worker thread waiting for the target ----------------------------------
def test_health_and_refusals_answer_while_every_worker_waits_for_the_target(target):
    limits = ServerLimits(max_generations=3, max_generations_per_client=2, max_sessions=80,
                          max_sessions_per_client=80)
    prompts = [[(3 * i + j) % 97 for j in range(4 + i % 5)] for i in range(45)]
    expected = [plain_greedy_generate(target, p, 2).token_ids for p in prompts]
    with running_server(target, {}, limits, TOKENS, backend_cls=GatedBackend) as (url, app, backend):
        http = httpx.Client(base_url=url, headers=AUTH[0], timeout=120)
        sessions = [http.post("/v1/sessions", json=_ngram_open(p)).json() for p in prompts]
        backend.gate.clear()  # the next target forward waits at the gate: everything queues behind it
        answers: dict = {}

        def call(key, headers, path, body):
            answers[key] = _post(url, path, body, headers, timeout=300)

        threads = [threading.Thread(target=call, args=(("verify", i), AUTH[0], f"/v1/sessions/{s['session_id']}/verify",
                                                       {"seq": s["length"], "tree": {"tokens": [s["first_token"]],
                                                                                      "parents": [-1]}}))
                   for i, s in enumerate(sessions)]
        generate = {"prompt": PROMPT, "max_tokens": 3}
        threads += [threading.Thread(target=call, args=(("generate", i), AUTH[i // 2], "/v1/generate", generate))
                    for i in range(3)]  # a, a, b: the server's 3 generations in flight
        for t in threads:
            t.start()
        try:
            assert backend.in_forward.wait(timeout=120)
            _wait_for(lambda: app.state.store.generations() == 3 and _waiting_workers() >= 40)
            # every worker thread now waits for the target; the event loop still answers
            quick = httpx.Client(base_url=url, timeout=20)
            assert quick.get("/v1/health").json()["status"] == "ok"
            assert quick.get("/v1/info", headers=AUTH[2]).status_code == 200
            over_client = quick.post("/v1/generate", json=generate, headers=AUTH[0])
            assert over_client.status_code == 429 and "per-client limit" in over_client.json()["error"]
            over_server = quick.post("/v1/generate", json=generate, headers=AUTH[2])
            assert over_server.status_code == 503 and "3 generations" in over_server.json()["error"]
            assert over_server.headers["retry-after"] == "1"
        finally:
            backend.gate.set()
            for t in threads:
                t.join(timeout=300)
        for i in range(len(sessions)):
            r = answers[("verify", i)]
            assert r.status_code == 200 and r.json()["next_token"] == expected[i][1], (i, r.text[:200])
        greedy = plain_greedy_generate(target, PROMPT, 3).token_ids
        assert all(answers[("generate", i)].json()["tokens"] == greedy for i in range(3))
        assert app.state.store.generations() == 0  # every slot was given back
        assert quick.post("/v1/generate", json=generate, headers=AUTH[2]).status_code == 200


def _waiting_workers() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("AnyIO worker"))


def _wait_for(condition, timeout=120.0):
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the server never reached the state the test waits for"
        time.sleep(0.05)


def test_a_dropped_stream_gives_its_generation_slot_back(target):
    limits = ServerLimits(max_generations=1, max_generations_per_client=1)
    with running_server(target, {}, limits, backend_cls=GatedBackend) as (url, app, backend):
        backend.gate.clear()
        backend.free_forwards = 2  # two tokens, then the generation waits at the gate
        try:
            with httpx.stream("POST", f"{url}/v1/generate", json={"prompt": PROMPT, "max_tokens": 40,
                                                                  "stream": True}, timeout=60) as response:
                assert response.status_code == 200
                lines = response.iter_lines()  # kept: a discarded line iterator would end the stream
                assert json.loads(next(lines))["tokens"]
                assert backend.in_forward.wait(timeout=60)
                busy = _post(url, "/v1/generate", {"prompt": PROMPT, "max_tokens": 2})
                assert busy.status_code == 429 and "per-client" in busy.json()["error"]  # the stream holds the slot
        finally:
            backend.gate.set()
        # the client hung up mid-stream: the slot comes back (the generation stops)
        _wait_for(lambda: app.state.store.generations() == 0)
        assert _post(url, "/v1/generate", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200


# -- 3. memory: per-sequence limit and server-wide token budget ----------------------------------------
class _NoContextWindow:
    """A model config that declares no context window (transformers' Llama config always does)."""

    def __init__(self, config) -> None:
        self._config = config

    def __getattr__(self, name):
        if name == "max_position_embeddings":
            raise AttributeError(name)
        return getattr(self._config, name)


def test_token_budget_and_sequence_limit_bound_a_target_without_a_context_window():
    target = make_target("llama", seed=9)
    target.hf_model.config = _NoContextWindow(target.hf_model.config)
    limits = ServerLimits(max_session_tokens=40, max_total_tokens=100, max_draft_nodes=16)
    with running_server(target, {}, limits) as (url, app, backend):
        assert backend.context_window is None
        info = httpx.get(f"{url}/v1/info").json()
        assert info["context_window"] == 40 and info["limits"]["max_total_tokens"] == 100
        # one sequence: at most 40 tokens, whatever the route
        r = _post(url, "/v1/sessions", _ngram_open(list(range(1, 41))))
        assert r.status_code == 413 and "at most 40 per sequence" in r.json()["error"]
        r = _post(url, "/v1/generate", {"prompt": [1, 2, 3], "max_tokens": 38})
        assert r.status_code == 413 and "at most 40 per sequence" in r.json()["error"]
        a = _post(url, "/v1/sessions", _ngram_open(list(range(1, 31)))).json()  # 30 tokens held
        b = _post(url, "/v1/sessions", _ngram_open(list(range(2, 52))[:39])).json()  # 69
        chain = {"seq": a["length"], "tree": {"tokens": [a["first_token"]] * 11, "parents": list(range(-1, 10))}}
        r = _post(url, f"/v1/sessions/{a['session_id']}/verify", chain)
        assert r.status_code == 413 and "depth 10 at position 30" in r.json()["error"]
        # the budget: 100 tokens over everything held at once
        r = _post(url, "/v1/sessions", _ngram_open(list(range(1, 33))))
        assert r.status_code == 503 and "budget of 100 tokens" in r.json()["error"] and r.headers["retry-after"]
        r = _post(url, "/v1/generate", {"prompt": [1, 2, 3], "max_tokens": 30})
        assert r.status_code == 503 and "budget" in r.json()["error"]
        assert app.state.store.tokens_held() == 69
        chain = {"seq": a["length"], "tree": {"tokens": [a["first_token"]] * 9, "parents": list(range(-1, 8))}}
        assert _post(url, f"/v1/sessions/{a['session_id']}/verify", chain).status_code == 200  # 69 + 9 <= 100
        assert app.state.store.tokens_held() <= 69 + 9
        httpx.delete(f"{url}/v1/sessions/{b['session_id']}")
        assert _post(url, "/v1/sessions", _ngram_open(list(range(1, 33)))).status_code == 200
        # the client sizes its request to the server's limit before opening anything
        with RemoteDraftingClient(url, "ngram") as client, pytest.raises(ValueError, match=r"window \(40\)"):
            client.generate([1, 2, 3], 38)


# -- 4. closing a session while its verify runs ----------------------------------------------------------
def test_close_waits_for_the_verify_in_flight_and_later_verifies_get_404(target, greedy):
    with running_server(target, {}, backend_cls=GatedBackend) as (url, app, backend):
        opened = _post(url, "/v1/sessions", _ngram_open(PROMPT)).json()
        sid = opened["session_id"]
        body = {"seq": opened["length"], "tree": {"tokens": greedy[:4], "parents": [-1, 0, 1, 2]}}
        answers = {}
        backend.gate.clear()
        verify = threading.Thread(target=lambda: answers.update(verify=_post(url, f"/v1/sessions/{sid}/verify", body)))
        close = threading.Thread(target=lambda: answers.update(close=httpx.delete(f"{url}/v1/sessions/{sid}",
                                                                                  timeout=60)))
        verify.start()
        try:
            assert backend.in_forward.wait(timeout=60)  # the verify is inside its target forward
            close.start()
            assert backend.closing.wait(timeout=60)  # the close has reached the backend
        finally:
            backend.gate.set()
        verify.join(timeout=60)
        close.join(timeout=60)
        assert answers["verify"].status_code == 200, answers["verify"].text
        assert answers["verify"].json()["accepted"] == greedy[1:4]
        assert answers["close"].status_code == 200
        again = _post(url, f"/v1/sessions/{sid}/verify", {**body, "seq": body["seq"] + 4,
                                                           "tree": {"tokens": [greedy[4]], "parents": [-1]}})
        assert again.status_code == 404 and again.json()["error"]


def test_backend_refuses_a_closed_session_with_404(target):
    from vllm_moa.serving.backend import SessionClosed
    from vllm_moa.serving.protocol import OpenRequest, VerifyRequest

    backend = TransformersBackend(target)
    session, opened = backend.open(OpenRequest.model_validate(_ngram_open(PROMPT)))
    backend.close(session)
    with pytest.raises(SessionClosed, match="closed") as err:
        backend.verify(session, VerifyRequest.model_validate(
            {"seq": opened.length, "tree": {"tokens": [opened.first_token], "parents": [-1]}}))
    assert err.value.status == 404


# -- 5. auth ---------------------------------------------------------------------------------------------
def test_auth_guards_the_documentation_and_comes_before_the_body(target):
    limits = ServerLimits(max_body_bytes=1000)
    with running_server(target, {}, limits, TOKENS[:1]) as (url, app, backend):
        for path in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect", "/v1/nowhere"):
            r = httpx.get(f"{url}{path}")
            assert r.status_code == 401 and "bearer token" in r.json()["error"], (path, r.status_code)
            assert r.headers["www-authenticate"] == "Bearer"
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert httpx.get(f"{url}{path}", headers=AUTH[0]).status_code == 200, path
        for headers in ({}, {"Authorization": "Bearer not-the-token-000"}):
            for content in (b"{not json", b"[" * 5000, b'{"prompt": "x"}'):
                for path in ("/v1/sessions", "/v1/generate", "/v1/sessions/abc/verify"):
                    r = httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json",
                                                                             **headers})
                    assert r.status_code == 401, (path, content[:10], headers, r.status_code, r.text)
        assert httpx.get(f"{url}/v1/health", headers={"Authorization": "Bearer wrong"}).status_code == 200
        r = httpx.post(f"{url}/v1/sessions", content=b"{not json", headers={"content-type": "application/json",
                                                                            **AUTH[0]})
        assert r.status_code == 422 and "JSON" in r.json()["error"]  # with the token: the body's own error


def test_listening_beyond_loopback_needs_tokens_or_insecure():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_exposure(host, auth_enabled=False)
    for host in ("0.0.0.0", "::", "192.168.1.10", "example.com"):
        with pytest.raises(ValueError, match="without bearer tokens.*--insecure"):
            check_exposure(host, auth_enabled=False)
        check_exposure(host, auth_enabled=True)
        check_exposure(host, auth_enabled=False, insecure=True)


def test_serve_cli_refuses_a_public_address_without_tokens_before_loading_anything():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "VLLM_MOA_TOKEN"}
    run = subprocess.run([sys.executable, "-m", "vllm_moa.cli", "serve", "--host", "0.0.0.0", "--target",
                          "/nonexistent/target"], env=env, capture_output=True, text=True, timeout=300)
    # refused for the address, before the (missing) target is even looked at
    assert run.returncode == 2 and "--insecure" in run.stderr and "Traceback" not in run.stderr, run.stderr


# -- 6. the client against an inconsistent server ---------------------------------------------------------
class _Tampering(TransformersBackend):
    """A server that answers well-formed JSON with contents that do not fit the request."""

    mode = ""

    def _sync(self, session, out, nodes, start):
        payload = super()._sync(session, out, nodes, start)
        if self.mode == "width" and payload.rows is not None:
            payload.rows = encode(torch.randn(len(nodes), 7))  # rows [n, 7] for an E-wide drafter
        return payload

    def verify(self, session, request):
        response = super().verify(session, request)
        if self.mode in ("vocab", "negative"):
            bad = self.target.vocab_size + 5 if self.mode == "vocab" else -1
            response = response.model_copy(update={"next_token": bad})
        return response

    def _generate(self, request):
        for token in super()._generate(request):
            yield self.target.vocab_size + 1 if self.mode == "vocab" else token


@pytest.mark.parametrize("mode", ["width", "vocab", "negative"])
def test_client_refuses_an_inconsistent_server_with_protocol_error(target, mode):
    drafter = tiny_drafters(target)["moa-tli0"]
    with running_server(target, {"m": drafter}, backend_cls=_Tampering) as (url, app, backend):
        backend.mode = mode
        with RemoteDraftingClient(url, drafter, target, num_draft=2) as client:
            with pytest.raises(ProtocolError, match="width|vocabulary" if mode == "width" else "vocabulary"):
                client.generate(PROMPT, 12)
        if mode == "vocab":
            with RemoteDraftingClient(url, None) as client, pytest.raises(ProtocolError, match="vocabulary"):
                client.info()
                client.generate(PROMPT, 4)
