"""GET /metrics of the verification server (serving/metrics.py, prometheus-client) over real HTTP
on 127.0.0.1: behind the bearer token, in the Prometheus text format, and every count equal to
what the client saw (verification rounds, accepted tokens, generated tokens, statuses by route
template, sessions held)."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving_utils import running_server, tiny_drafters
from tiny_models import make_target

from vllm_moa.serving.client import RemoteDraftingClient
from vllm_moa.serving.protocol import ServerLimits

TOKEN = "metrics-token-0123456789"
VERIFY = "/v1/sessions/{session_id}/verify"


@pytest.fixture(scope="module")
def world():
    target = make_target("qwen2")
    limits = ServerLimits(max_prompt_tokens=200, max_draft_nodes=12, max_new_tokens=64, session_idle_ttl_s=60)
    drafters = tiny_drafters(target)
    with running_server(target, drafters, limits, [TOKEN]) as (url, app, backend):
        yield {"target": target, "drafters": drafters, "url": url}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    r = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_need_the_token(world):
    assert httpx.get(f"{world['url']}/metrics").status_code == 401


def test_verification_counts_equal_what_the_client_saw(world):
    before = scrape(world["url"])
    # pipeline=1: every verify request the client sends is one it waits for (a pipelined round that
    # its predecessor made moot is answered 409 whenever it arrives, perhaps after generate returns)
    with RemoteDraftingClient(world["url"], world["drafters"]["moa-tli0"], world["target"], token=TOKEN,
                              pipeline=1) as client:
        result = client.generate([11, 12, 13, 14, 15, 11, 12], 40)
    after = scrape(world["url"])
    assert result.verify_calls >= 1
    assert delta(after, before, "vllm_moa_verify_rounds_total") == result.verify_calls
    assert delta(after, before, "vllm_moa_http_requests_total", route=VERIFY, status="200") == result.verify_calls
    # accepted_per_verify counts each round's path with its root; the metric counts accepted drafts
    accepted = delta(after, before, "vllm_moa_verify_accepted_tokens_total")
    assert accepted == sum(result.accepted_per_verify) - len(result.accepted_per_verify)
    assert 0 <= accepted <= delta(after, before, "vllm_moa_verify_draft_tokens_total")
    assert delta(after, before, "vllm_moa_verify_draft_tokens_total") >= result.verify_calls
    assert delta(after, before, "vllm_moa_http_request_seconds_count", route=VERIFY) == result.verify_calls
    assert after[("vllm_moa_sessions_open", ())] == 0  # the client closed its session


def test_generated_tokens_whole_and_streamed(world):
    headers = {"authorization": f"Bearer {TOKEN}"}
    before = scrape(world["url"])
    whole = httpx.post(f"{world['url']}/v1/generate", json={"prompt": [1, 2, 3], "max_tokens": 7}, headers=headers)
    assert whole.status_code == 200 and len(whole.json()["tokens"]) == 7
    with httpx.stream("POST", f"{world['url']}/v1/generate", headers=headers,
                      json={"prompt": [4, 5], "max_tokens": 5, "stream": True}) as streamed:
        lines = list(streamed.iter_lines())
    assert sum(len(line) > 0 and '"tokens"' in line for line in lines) == 5
    after = scrape(world["url"])
    assert delta(after, before, "vllm_moa_generated_tokens_total") == 12
    assert delta(after, before, "vllm_moa_http_requests_total", route="/v1/generate", status="200") == 2
    assert after[("vllm_moa_generations_running", ())] == 0


def test_sessions_and_refusals_by_route_template(world):
    headers = {"authorization": f"Bearer {TOKEN}"}
    before = scrape(world["url"])
    opened = httpx.post(f"{world['url']}/v1/sessions", json={"prompt": [1, 2, 3, 4], "drafter": {"kind": "ngram"}}, headers=headers)
    assert opened.status_code == 200, opened.text
    assert scrape(world["url"])[("vllm_moa_sessions_open", ())] == 1
    assert scrape(world["url"])[("vllm_moa_tokens_held", ())] == 4  # its prompt's K/V
    session = opened.json()["session_id"]
    assert httpx.delete(f"{world['url']}/v1/sessions/{session}", headers=headers).status_code == 200
    assert httpx.get(f"{world['url']}/no/such/route/{session}", headers=headers).status_code == 404
    assert httpx.post(f"{world['url']}/v1/generate", json={"prompt": [1], "max_tokens": 65},
                      headers=headers).status_code == 413
    assert httpx.get(f"{world['url']}/v1/info").status_code == 401
    after = scrape(world["url"])
    assert after[("vllm_moa_sessions_open", ())] == 0
    assert delta(after, before, "vllm_moa_http_requests_total", route="/v1/sessions", status="200") == 1
    assert delta(after, before, "vllm_moa_http_requests_total", route="/v1/sessions/{session_id}", status="200") == 1
    assert delta(after, before, "vllm_moa_http_requests_total", route="unmatched", status="404") == 1
    assert delta(after, before, "vllm_moa_http_requests_total", route="/v1/generate", status="413") == 1
    assert delta(after, before, "vllm_moa_http_requests_total", route="/v1/info", status="401") == 1
    # the label set is the route templates: a raw path (a session id) never becomes a label
    assert not [labels for (_, labels) in after if any(session in value for _, value in labels)]
