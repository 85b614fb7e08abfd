"""The verification server and the remote drafting client over real HTTP on 127.0.0.1: exact
greedy output for every drafter, chains and trees; streaming; sampling; sessions that expire or
vanish under the client; bearer-token auth; limits and malformed input answered with 4xx."""

import json

import httpx
import pytest
import torch
from serving_utils import CLI, DRAFTER_KINDS, cli_server, running_server, tiny_drafters
from tiny_models import make_target

from vllm_moa.decoding.chain import plain_greedy_generate
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.serving.client import RemoteDraftingClient, RequestRefused, Transcript
from vllm_moa.serving.local import open_local
from vllm_moa.serving.protocol import ServerLimits

TOKEN = "test-token-0123456789"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def world():
    target = make_target("qwen2")
    drafters = tiny_drafters(target)
    clock = FakeClock()
    limits = ServerLimits(max_body_bytes=64_000, max_prompt_tokens=200, max_draft_nodes=12, max_new_tokens=64,
                          max_sessions=40, max_sessions_per_client=3, session_idle_ttl_s=60)
    with running_server(target, drafters, limits, [TOKEN, "second-token-abcdef"], clock=clock) as (url, app, backend):
        yield {"target": target, "drafters": drafters, "url": url, "app": app, "backend": backend, "clock": clock}


def _client(world, drafter, **kwargs):
    return RemoteDraftingClient(world["url"], drafter, world["target"], token=TOKEN, **kwargs)


@pytest.mark.parametrize("kind", [*DRAFTER_KINDS, "api"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_remote_greedy_equals_target_greedy(world, kind, shape):
    drafter = None if kind == "api" else world["drafters"][kind]
    prompt = [11, 12, 13, 14, 15, 11, 12]
    expected = plain_greedy_generate(world["target"], prompt, 40).token_ids
    with _client(world, drafter, tree_top_k=3 if shape == "tree" else None) as client:
        view = Transcript()
        result = client.generate(prompt, 40, on_event=view.apply)
    assert result.token_ids == expected and view.tokens == expected
    assert result.num_verified == view.num_verified == 40 and result.finish_reason == "length"
    assert result.calls >= 1 and result.bytes_received > 0
    if kind != "api":
        assert result.verify_calls == len(result.accepted_per_verify) >= 1
        assert 40 <= 1 + sum(result.accepted_per_verify) <= 40 + 12  # first token + each round's path


def test_eos_stops_and_int8_payload_stays_exact(world):
    target = world["target"]
    prompt = [2, 3, 5, 7, 11]
    greedy = plain_greedy_generate(target, prompt, 30).token_ids
    eos = greedy[9]
    cut = greedy.index(eos) + 1
    with _client(world, world["drafters"]["moa-tli1"], encoding="int8", num_draft=5) as client:
        result = client.generate(prompt, 30, eos_token_id=eos)
    assert result.token_ids == greedy[:cut] and result.finish_reason == "eos"


def test_sampling_is_reproducible_with_a_seed(world):
    sampling = SamplingParams(temperature=1.0)
    prompt = [4, 8, 15, 16, 23, 42]
    greedy = plain_greedy_generate(world["target"], prompt, 24).token_ids
    with _client(world, world["drafters"]["moa-tli0"]) as client:
        runs = [client.generate(prompt, 24, sampling, seed=seed).token_ids for seed in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]  # the seed, not a fixed one, decides the samples
    assert all(len(r) == 24 and all(0 <= t < world["target"].vocab_size for t in r) for r in runs)
    assert any(r != greedy for r in runs)  # temperature 1 on a random model: not the greedy path


def test_expired_session_is_reopened_transparently(world):
    """The server forgets the session mid-generation (idle TTL passes on its clock): the client gets
    404, reopens at its verified prefix, and the output is still exact."""
    target, clock = world["target"], world["clock"]
    prompt = [9, 9, 8, 7, 6]
    expected = plain_greedy_generate(target, prompt, 40).token_ids
    reopened_before = world["backend"].counters["opens"]

    def expire(event):
        if event.kind == "verified" and 10 <= event.start < 14:
            clock.now += 61  # every session on the server is now idle for longer than its TTL

    with _client(world, world["drafters"]["eagle"], num_draft=2) as client:
        result = client.generate(prompt, 40, on_event=expire)
    assert result.token_ids == expected and result.reopens >= 1
    assert world["backend"].counters["opens"] >= reopened_before + 2


def test_auth_is_required_when_tokens_are_set(world):
    url = world["url"]
    assert httpx.get(f"{url}/v1/health").status_code == 200  # liveness stays open
    for headers in ({}, {"Authorization": "Bearer wrong-token-000000"}, {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": "Bearer"}):
        for method, path, body in (("GET", "/v1/info", None), ("POST", "/v1/sessions", {"prompt": [1]}),
                                   ("POST", "/v1/sessions/abc/verify", {}), ("DELETE", "/v1/sessions/abc", None),
                                   ("POST", "/v1/generate", {"prompt": [1], "max_tokens": 1})):
            r = httpx.request(method, f"{url}{path}", json=body, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert "bearer token" in r.json()["error"] and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{url}/v1/info", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    with pytest.raises(RequestRefused, match="401"):
        RemoteDraftingClient(url, "ngram", token="not-the-token").generate([1, 2, 3], 4)


def _open_body(world, prompt, kind="moa-tli0"):
    local = open_local(world["drafters"][kind], world["target"])
    return {"prompt": prompt, "drafter": local.declaration().model_dump()}


def test_limits_and_bad_input_get_4xx_with_a_message(world):
    url, auth = world["url"], {"Authorization": f"Bearer {TOKEN}"}
    http = httpx.Client(base_url=url, headers=auth)

    def post(path, body=None, content=None, headers=None):
        return http.post(path, json=body, content=content, headers=headers)

    # body size: refused from Content-Length before parsing, and mid-way for a chunked body
    r = post("/v1/generate", content=b"x" * 70_000, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]
    r = post("/v1/generate", content=iter([b"[" * 10_000] * 10), headers={"content-type": "application/json"})
    assert r.status_code == 413
    cases = [
        ("/v1/sessions", {**_open_body(world, list(range(1, 60)) * 4)}, 413, "at most 200"),
        ("/v1/sessions", _open_body(world, [5, 500]), 400, "vocabulary"),
        ("/v1/sessions", {**_open_body(world, [1, 2]), "sync_from": 3}, 400, "sync_from"),
        ("/v1/sessions", {"prompt": [1, 2], "drafter": {"kind": "ngram"}, "encoding": "fp8"}, 422, "encoding"),
        ("/v1/sessions", {"prompt": "hello", "drafter": {"kind": "ngram"}}, 422, "prompt"),
        ("/v1/generate", {"prompt": [1, 2], "max_tokens": 65}, 413, "max_tokens=65"),
        ("/v1/generate", {"prompt": [1, 2], "max_tokens": 4, "sampling": {"temperature": -1}}, 422, "temperature"),
        ("/v1/sessions/nope/verify", {"seq": 1, "tree": {"tokens": [1], "parents": [-1]}}, 404, "no session"),
    ]
    for path, body, status, message in cases:
        r = post(path, body)
        assert r.status_code == status and message in r.json()["error"], (path, r.status_code, r.text)
    r = post("/v1/sessions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "JSON" in r.json()["error"]
    # a real session: draft too large, malformed trees, stale positions
    opened = post("/v1/sessions", _open_body(world, [3, 4, 5])).json()
    sid, seq, root = opened["session_id"], opened["length"], opened["first_token"]
    verify = f"/v1/sessions/{sid}/verify"
    tree_cases = [
        ({"seq": seq, "tree": {"tokens": [root] * 14, "parents": [-1] + list(range(13))}}, 413, "at most 12"),
        ({"seq": seq, "tree": {"tokens": [root, 1], "parents": [-1, 1]}}, 422, "parents must come before"),
        ({"seq": seq + 5, "tree": {"tokens": [root], "parents": [-1]}}, 409, "ahead"),
        ({"seq": seq, "tree": {"tokens": [(root + 1) % 97], "parents": [-1]}}, 409, "root token"),
        ({"seq": 0, "tree": {"tokens": [root], "parents": [-1]}}, 422, "seq"),
    ]
    for body, status, message in tree_cases:
        r = post(verify, body)
        assert r.status_code == status and message in r.json()["error"], (body, r.status_code, r.text)
    assert post(verify, {"seq": seq, "tree": {"tokens": [root], "parents": [-1]}}).status_code == 200
    # another client (token) cannot see this session
    other = httpx.post(f"{url}{verify}", json={"seq": seq, "tree": {"tokens": [root], "parents": [-1]}},
                       headers={"Authorization": "Bearer second-token-abcdef"})
    assert other.status_code == 404
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200
    assert http.delete(f"/v1/sessions/{sid}").status_code == 404


def test_sessions_per_client_are_limited(world):
    http = httpx.Client(base_url=world["url"], headers={"Authorization": "Bearer second-token-abcdef"})
    ids = [http.post("/v1/sessions", json=_open_body(world, [1, 2, 3])).json()["session_id"] for _ in range(3)]
    r = http.post("/v1/sessions", json=_open_body(world, [1, 2, 3]))
    assert r.status_code == 429 and "per-client limit" in r.json()["error"]
    # the first client (the other token) is not affected
    with _client(world, "ngram") as client:
        assert client.generate([1, 2, 3], 5).num_verified == 5
    http.delete(f"/v1/sessions/{ids[0]}")
    assert http.post("/v1/sessions", json=_open_body(world, [1, 2, 3])).status_code == 200


def test_drafter_for_another_target_is_refused(world):
    other = make_target("qwen2", seed=3)
    with pytest.raises(RequestRefused, match="409.*does not match this server's target"):
        RemoteDraftingClient(world["url"], tiny_drafters(other)["eagle"], other, token=TOKEN).generate([1, 2], 4)


def test_openapi_schema_documents_the_protocol(world):
    schema = httpx.get(f"{world['url']}/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert {"/v1/sessions", "/v1/sessions/{session_id}/verify", "/v1/generate", "/v1/info"} <= set(schema["paths"])


def test_cli_serve_and_client_end_to_end_on_the_demo_models(tmp_path):
    """`vllm-moa serve` (demo target, token from the environment) and `vllm-moa client` with the
    shipped MoA drafter: the client's text equals plain greedy decoding on the demo target."""
    import os
    import subprocess

    from transformers import AutoTokenizer

    from vllm_moa.shipped import SHIPPED
    from vllm_moa.target import TargetModel

    env = {**os.environ, "VLLM_MOA_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    with cli_server(env=env, start_timeout=120) as url:
        prompt = "def read_config(path):"
        run = subprocess.run([*CLI, "client", "--url", url, "--prompt", prompt,
                              "--max-new-tokens", "40", "--json", "--threads", "1"],
                             env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        target = TargetModel.from_pretrained(SHIPPED / "target")
        tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED / "target"))
        expected = plain_greedy_generate(target, tokenizer(prompt)["input_ids"], 40,
                                         eos_token_id=tokenizer.eos_token_id).token_ids
        assert out["token_ids"] == expected and out["verified"] == len(expected)
        assert out["verify_calls"] < len(expected)  # the trained drafter gets more than one token per call
        refused = subprocess.run([*CLI, "client", "--url", url, "--prompt", prompt,
                                  "--max-new-tokens", "4"], env={**env, "VLLM_MOA_TOKEN": ""},
                                 capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2 and "401" in refused.stderr


def test_the_first_round_of_a_session_drafts_no_further_than_the_servers_kv_block(world):
    """A server whose rounds read a prefix cache (vLLM's) verifies a session's first round only up
    to its root's KV block and says so in /v1/info (`kv_block_size`); the client's first round then
    drafts no further, and the rounds after it as deep as asked. Here the real server answers for
    blocks of 8 tokens; the root of a 14-token prompt sits at position 14, 1 slot before its block ends."""
    backend = world["backend"]
    prompt = [11, 12, 13, 14, 15, 11, 12, 3, 4, 5, 6, 7, 8, 9]
    expected = plain_greedy_generate(world["target"], prompt, 24).token_ids
    backend.round_block_size = 8
    try:
        with _client(world, world["drafters"]["moa-tli0"], num_draft=5, lookup=False) as client:
            assert client.info().kv_block_size == 8
            result = client.generate(prompt, 24)
    finally:
        backend.round_block_size = None
    assert result.token_ids == expected
    assert result.drafted_per_verify[0] == 8 - 1 - len(prompt) % 8 == 1
    assert max(result.drafted_per_verify[1:]) == 5
    with _client(world, world["drafters"]["moa-tli0"], num_draft=5, lookup=False) as client:
        assert client.info().kv_block_size is None
        assert client.generate(prompt, 24).drafted_per_verify[0] == 5


def test_a_client_asked_for_trees_drafts_the_tree_or_a_chain_by_measured_speed(world):
    """tree_top_k with chain_if_faster (the default): both shapes are tried, each round's tokens per
    second decide after that, and the output is the target's greedy output; chain_if_faster=False
    drafts the tree every round."""
    prompt = [4, 8, 15, 16, 23, 42, 4, 8]
    expected = plain_greedy_generate(world["target"], prompt, 48).token_ids
    with _client(world, world["drafters"]["moa-tli0"], tree_top_k=3, lookup=False) as client:
        result = client.generate(prompt, 48)
    assert result.token_ids == expected
    assert result.shape_rounds.get("tree", 0) >= 2 and result.shape_rounds.get("chain", 0) >= 2, result.shape_rounds
    assert sum(result.shape_rounds.values()) == len(result.accepted_per_verify)
    with _client(world, world["drafters"]["moa-tli0"], tree_top_k=3, lookup=False, chain_if_faster=False) as client:
        result = client.generate(prompt, 48)
    assert result.token_ids == expected and set(result.shape_rounds) == {"tree"}


def test_a_windowed_moa_client_asks_only_for_the_rows_it_reads(world, monkeypatch):
    """A MoA drafter with an attention window W (TLI 0) reads only the last W verified rows, and
    rows only grow: its open asks the server for the prompt's last W rows (`sync_from`) and keeps
    zeros in the rows' place before them. It drafts exactly as a session given every row (the
    logits, step after step), and the client's output is the target's greedy output with the same
    rounds, for fewer bytes."""
    import copy

    from vllm_moa.kinds.moa.client import LocalMoA
    from vllm_moa.serving.local import decode_sync
    from vllm_moa.serving.protocol import OpenRequest

    target, backend = world["target"], world["backend"]
    drafter = copy.deepcopy(world["drafters"]["moa-tli0"])
    drafter.attention_window = 32
    prompt = [3 + (7 * i) % 50 for i in range(70)]
    sessions = []
    for windowed in (False, True):
        local = open_local(drafter, target)
        rows_from = local.rows_wanted_from(len(prompt)) if windowed else 0
        session, opened = backend.open(OpenRequest.model_validate(
            {"prompt": prompt, "drafter": local.declaration().model_dump(), "sync_from": rows_from}))
        backend.close(session)
        local.start(prompt, decode_sync(opened.sync, target.dtype, target.device, target.signature))
        sessions.append((local, opened.first_token, opened.sync.count))
    (every_row, first, _), (windowed, _, rows_sent) = sessions
    assert rows_sent == 32 and windowed.verified == every_row.verified == len(prompt)
    chain = [first]
    for _ in range(6):
        want, got = every_row._chain_logits(chain[-1:]), windowed._chain_logits(chain[-1:])
        assert torch.allclose(got, want, atol=1e-6), float((got - want).abs().max())
        chain.append(int(want.argmax()))

    expected = plain_greedy_generate(target, prompt, 24).token_ids
    with _client(world, drafter, num_draft=4, lookup=False) as client:
        asked = client.generate(prompt, 24)
    monkeypatch.setattr(LocalMoA, "rows_wanted_from", lambda self, prompt_len: 0)
    with _client(world, drafter, num_draft=4, lookup=False) as client:
        all_rows = client.generate(prompt, 24)
    assert asked.token_ids == all_rows.token_ids == expected
    assert asked.accepted_per_verify == all_rows.accepted_per_verify
    assert asked.bytes_received < all_rows.bytes_received
