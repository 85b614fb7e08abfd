"""Fuzzing the server over HTTP on 127.0.0.1: schema-driven (schemathesis, from the app's own
OpenAPI document: valid and invalid requests for every route) and raw (hypothesis: near-valid
payloads with hostile values, arbitrary JSON, arbitrary bytes, deep nesting). No request may get a
5xx, every refusal carries a message, and a well-behaved client keeps getting exact answers."""

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_utils import running_server, tiny_drafters
from tiny_models import make_target

from vllm_moa.decoding.chain import plain_greedy_generate
from vllm_moa.serving.client import RemoteDraftingClient
from vllm_moa.serving.local import open_local
from vllm_moa.serving.protocol import ServerLimits

TOKEN = "fuzz-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def world():
    target = make_target("llama", seed=6)
    drafters = tiny_drafters(target)
    limits = ServerLimits(max_body_bytes=32_000, max_prompt_tokens=64, max_draft_nodes=16, max_new_tokens=16,
                          max_sessions=2_000, max_sessions_per_client=2_000, round_wait_s=0.2)
    with running_server(target, drafters, limits, [TOKEN]) as (url, app, backend):
        http = httpx.Client(base_url=url, headers=AUTH, timeout=30)
        decl = open_local(drafters["moa-tli1"], target).declaration().model_dump()
        opened = http.post("/v1/sessions", json={"prompt": [1, 2, 3], "drafter": decl}).json()
        yield {"target": target, "drafters": drafters, "url": url, "http": http, "decl": decl, "session": opened}
        http.close()


def _check_answer(response: httpx.Response, what) -> None:
    assert response.status_code < 500, (what, response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert response.json()["error"], what
    elif response.headers.get("content-type", "").startswith("application/x-ndjson"):  # a complete stream
        assert json.loads(response.text.splitlines()[-1]).get("done"), (what, response.text[-300:])


@pytest.fixture(scope="module")
def api_schema(world):
    return schemathesis.openapi.from_url(f"{world['url']}/openapi.json", headers=AUTH)  # the document needs auth too


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_schema_driven_fuzz_never_gets_a_server_error(case):
    response = case.call(headers=AUTH, timeout=30)
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:300])


# -- raw hypothesis fuzzing -----------------------------------------------------------------------
ints = st.one_of(st.integers(-3, 200), st.integers(-(2**70), 2**70), st.sampled_from([2**31 - 1, 2**31, 2**63]))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8)),
    lambda children: st.one_of(st.lists(children, max_size=6), st.dictionaries(st.text(max_size=6), children,
                                                                               max_size=4)),
    max_leaves=30,
)
token_lists = st.one_of(st.lists(ints, max_size=24), json_values)
# subnormal, tiny and huge temperatures (tiny ones once overflowed the warped logits into a 500)
temperatures = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                         st.sampled_from([5e-324, 1e-310, 1e-40, 1e-8, 1e-5, 100.0, 100.5, 1e308]),
                         st.floats(0, 1e-3, allow_subnormal=True))
sampling_options = st.one_of(st.fixed_dictionaries({
    "temperature": temperatures, "top_k": ints, "top_p": st.floats(allow_nan=True, allow_infinity=True), "seed": ints}),
    st.fixed_dictionaries({"temperature": temperatures}), json_values)


@st.composite
def near_valid(draw, world):
    """(method, path, body) close to the protocol, with one or more fields hostile."""
    session = world["session"]
    route = draw(st.sampled_from(["open", "verify", "generate", "close", "info"]))
    if route == "open":
        declared = st.fixed_dictionaries({
            "kind": st.sampled_from(["moa", "eagle", "independent", "ngram", "x"]),
            "target": st.one_of(st.just(world["decl"]["target"]), json_values),
            "lsa_fingerprint": st.one_of(st.just(world["decl"]["lsa_fingerprint"]), st.text(max_size=70)),
            "tli": ints})
        body = {"prompt": draw(token_lists), "drafter": draw(st.one_of(st.just(world["decl"]), json_values, declared))}
        for key in draw(st.sets(st.sampled_from(["pending", "sync_from", "encoding", "sampling", "junk"]))):
            body[key] = draw(sampling_options if key == "sampling" else
                             st.one_of(ints, st.sampled_from(["fp16", "int8", "fp8"]), json_values))
        return "POST", "/v1/sessions", body
    if route == "verify":
        sid = draw(st.one_of(st.just(session["session_id"]), st.text(max_size=70)))
        tokens = draw(token_lists)
        parents = draw(st.one_of(st.lists(st.integers(-2, 30), max_size=24), json_values))
        body = {"seq": draw(st.one_of(ints, st.just(session["length"]), json_values)),
                "tree": draw(st.one_of(st.just({"tokens": tokens, "parents": parents}), json_values))}
        for key in draw(st.sets(st.sampled_from(["round", "after"]))):  # pipelined rounds' fields
            body[key] = draw(st.one_of(ints, json_values))
        return "POST", f"/v1/sessions/{sid}/verify", body
    if route == "generate":
        body = {"prompt": draw(token_lists), "max_tokens": draw(st.one_of(ints, json_values)),
                "stream": draw(st.one_of(st.booleans(), json_values)),
                "sampling": draw(sampling_options)}
        return "POST", "/v1/generate", body
    if route == "close":
        return "DELETE", f"/v1/sessions/{draw(st.text(max_size=70))}", None
    return "GET", "/v1/info", None


@pytest.fixture(scope="module")
def strategies(world):
    return near_valid(world)


def test_hostile_payloads_get_4xx_and_the_server_keeps_serving(world, strategies):
    http = world["http"]

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(request=strategies)
    def near_valid_requests(request):
        method, path, body = request
        content = json.dumps(body, allow_nan=True).encode() if body is not None else None
        try:
            response = http.request(method, path, content=content, headers={"content-type": "application/json"})
        except httpx.InvalidURL:
            return  # the client library refuses to send it at all
        _check_answer(response, request)

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(path=st.sampled_from(["/v1/sessions", f"/v1/sessions/{world['session']['session_id']}/verify",
                                 "/v1/generate"]),
           body=st.one_of(st.binary(max_size=400), st.text(max_size=200).map(str.encode),
                          st.integers(1, 40_000).map(lambda n: b"[" * n), st.integers(1, 5_000).map(
                              lambda n: b'{"prompt":' * n)),
           content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                         "application/json; charset=latin-1"]))
    def raw_bodies(path, body, content_type):
        response = http.post(path, content=body, headers={"content-type": content_type})
        _check_answer(response, (path, body[:60], content_type))

    near_valid_requests()
    raw_bodies()
    # a well-behaved client still gets exact results
    target = world["target"]
    with RemoteDraftingClient(world["url"], world["drafters"]["moa-tli0"], target, token=TOKEN) as client:
        result = client.generate([3, 3, 7, 1], 16)
    assert result.token_ids == plain_greedy_generate(target, [3, 3, 7, 1], 16).token_ids
    assert httpx.get(f"{world['url']}/v1/health").json()["status"] == "ok"
