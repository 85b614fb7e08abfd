"""Lost connections, through the netsim proxy on 127.0.0.1: the connection is cut at random byte
offsets (mid-request, mid-response, between calls) and stays down for a random number of connection
attempts (refused, or blackholed until the client times out). Every trial's final output must equal
the target's greedy output, and the stream of events must add up to it: nothing lost, nothing
duplicated, every token verified in the end. Also: a server restart, the plain API baseline,
giving up while the server stays unreachable, and the trained demo drafter."""

import random
import threading
import time
from collections import Counter

import pytest
from serving_utils import DRAFTER_KINDS, running_server, tiny_drafters
from tiny_models import make_target

from vllm_moa.decoding.chain import plain_greedy_generate
from vllm_moa.serving.client import RemoteDraftingClient, Transcript
from vllm_moa.serving.netsim import LinkConditions, NetSim
from vllm_moa.serving.protocol import ServerLimits
from vllm_moa.serving.server import ServerThread, create_app

BYTE_TRIALS = 56
TIME_TRIALS = 8


@pytest.fixture(scope="module")
def world():
    target = make_target("llama", seed=2)
    drafters = tiny_drafters(target)
    limits = ServerLimits(max_draft_nodes=16, max_sessions_per_client=256)
    with running_server(target, drafters, limits) as (url, app, backend):
        port = int(url.rsplit(":", 1)[1])
        with NetSim(port, LinkConditions(rtt_ms=2.0), seed=7) as sim:
            yield {"target": target, "drafters": drafters, "backend": backend, "sim": sim, "port": port}


def _client(world, drafter, rng, target=None, **kwargs):
    options = dict(timeout=0.3, connect_timeout=0.3, backoff_s=0.005, backoff_max_s=0.05, give_up_after_s=60,
                   seed=rng.randrange(1 << 30), num_draft=rng.choice([None, 2, 5]),
                   tree_top_k=rng.choice([None, None, 2]), max_unverified=rng.choice([8, 64]),
                   offline_chunk=rng.choice([1, 4]))
    options.update(kwargs)
    return RemoteDraftingClient(world["sim"].url, drafter, target or world["target"], **options)


def _check(result, view, expected, context):
    assert result.token_ids == expected, context
    assert view.tokens == expected and view.num_verified == len(expected), context
    assert result.num_verified == len(expected) and result.finish_reason == "length", context


def test_random_byte_cuts_recover_exactly(world):
    sim, target, backend = world["sim"], world["target"], world["backend"]
    rng = random.Random(20250)
    totals = Counter()
    rewinds_before = backend.counters["rewinds"]
    for trial in range(BYTE_TRIALS):
        kind = DRAFTER_KINDS[trial % len(DRAFTER_KINDS)]
        prompt = [rng.randrange(target.vocab_size) for _ in range(rng.randrange(2, 12))]
        n = rng.randrange(16, 48)
        expected = plain_greedy_generate(target, prompt, n).token_ids
        cut_at = rng.randrange(0, 24_000)
        then, attempts = rng.choice([None, "refuse", "blackhole"]), rng.randrange(0, 4)
        before = sim.snapshot().cuts
        sim.cut_after_bytes(cut_at, then=then, connections=attempts)
        with _client(world, world["drafters"][kind], rng) as client:
            view = Transcript()
            result = client.generate(prompt, n, on_event=view.apply)
        sim.disarm()
        sim.set_down(None)
        context = dict(trial=trial, kind=kind, cut_at=cut_at, then=then, attempts=attempts)
        _check(result, view, expected, context)
        totals["cut"] += sim.snapshot().cuts > before
        for key in ("failures", "disconnects", "offline_tokens", "offline_confirmed", "rollbacks", "reopens",
                    "pipelined_rounds"):
            totals[key] += getattr(result, key)
    print("fault totals", dict(totals), "rewinds", backend.counters["rewinds"] - rewinds_before)
    # the trials really went through the paths they are meant to test
    assert totals["cut"] >= BYTE_TRIALS * 2 // 3, totals
    assert totals["disconnects"] >= BYTE_TRIALS // 2 and totals["offline_tokens"] > 0, totals
    # (offline tokens confirmed after a resync need drafts the target agrees with: the random tiny
    # drafters here rarely manage it, and whether they do depends on timing; the trained demo
    # drafter's test below asserts it)
    assert totals["rollbacks"] > 0, totals
    assert backend.counters["rewinds"] > rewinds_before, "no cut ever lost a processed verify's answer"


def test_cuts_at_random_times_recover_exactly(world):
    """Three cuts per trial at random times within the generation: each trial's cuts must reset
    live connections, and the clients must have seen calls fail (not only idle connections)."""
    sim, target = world["sim"], world["target"]
    rng = random.Random(77)
    failures = 0
    for trial in range(TIME_TRIALS):
        kind = DRAFTER_KINDS[trial % len(DRAFTER_KINDS)]
        prompt = [rng.randrange(target.vocab_size) for _ in range(5)]
        expected = plain_greedy_generate(target, prompt, 40).token_ids
        options = rng.randrange(1 << 30)  # the same client options for the timing run and the cut run
        started = time.monotonic()
        with _client(world, world["drafters"][kind], random.Random(options)) as client:
            assert client.generate(prompt, 40).token_ids == expected
        span = time.monotonic() - started  # how long this generation runs here without cuts
        context = dict(trial=trial, kind=kind)
        # A loaded machine can run the cut run faster than the timing run (or stall the timers),
        # so all three cuts may land after it ended: such an attempt tests nothing and is redrawn.
        for attempt in range(4):
            before = sim.snapshot()
            timers = [threading.Timer(rng.uniform(0.0, span / 2), sim.cut) for _ in range(3)]
            for timer in timers:
                timer.start()
            with _client(world, world["drafters"][kind], random.Random(options)) as client:
                view = Transcript()
                result = client.generate(prompt, 40, on_event=view.apply)
            for timer in timers:
                timer.join()
            _check(result, view, expected, dict(context, attempt=attempt))
            if sim.snapshot().reset_connections > before.reset_connections:
                break
        assert sim.snapshot().reset_connections > before.reset_connections, ("no cut hit the generation", context)
        failures += result.failures
    assert failures > 0, "no cut ever interrupted a call in flight"


def test_api_baseline_resumes_a_dropped_stream(world):
    sim, target = world["sim"], world["target"]
    rng = random.Random(5)
    for trial in range(4):
        prompt = [rng.randrange(target.vocab_size) for _ in range(6)]
        expected = plain_greedy_generate(target, prompt, 40).token_ids
        sim.cut_after_bytes(rng.randrange(200, 900), then="refuse", connections=2)  # of ~1.3 kB
        with _client(world, None, rng) as client:
            view = Transcript()
            result = client.generate(prompt, 40, on_event=view.apply)
        sim.disarm()
        _check(result, view, expected, dict(trial=trial))
        assert result.failures >= 1


def test_server_restart_mid_generation(world):
    """The server process goes away (its sessions with it) and a fresh one comes up on the same
    port: the client drafts alone meanwhile, then gets 404, reopens and resyncs."""
    target, drafters = world["target"], world["drafters"]
    backend = world["backend"]
    with running_server(target, drafters) as (url, app, _):
        port = int(url.rsplit(":", 1)[1])
        with NetSim(port, seed=3) as proxy:
            prompt = [5, 10, 15, 20]
            expected = plain_greedy_generate(target, prompt, 48).token_ids
            restarted = {}

            def restart(event):
                if event.kind == "verified" and event.start >= 12 and not restarted:
                    restarted["old"] = True
                    proxy.set_down("refuse")  # the old server is gone for good
                    fresh = ServerThread(create_app(type(backend)(target, {k: v for k, v in drafters.items()
                                                                           if not isinstance(v, str)})))
                    restarted["server"] = fresh
                    fresh.start()
                    proxy.upstream_port = fresh.port
                    proxy.set_down(None)

            client = RemoteDraftingClient(proxy.url, drafters["moa-tli0"], target, timeout=0.5, backoff_s=0.005,
                                          num_draft=3)
            view = Transcript()
            result = client.generate(prompt, 48, on_event=lambda e: (view.apply(e), restart(e)))
            client.close()
            restarted["server"].stop()
    _check(result, view, expected, {})
    assert result.reopens == 1


def test_giving_up_returns_the_unverified_tail_marked(world):
    target, sim = world["target"], world["sim"]
    prompt = [1, 2, 3, 4, 5, 6]
    expected = plain_greedy_generate(target, prompt, 40).token_ids
    drafter = world["drafters"]["moa-tli0"]

    def go_down(event):
        if event.kind == "verified" and event.start >= 5:
            sim.set_down("refuse")

    client = RemoteDraftingClient(sim.url, drafter, target, timeout=0.3, backoff_s=0.01, backoff_max_s=0.05,
                                  give_up_after_s=0.5, num_draft=2, max_unverified=40)
    view = Transcript()
    result = client.generate(prompt, 40, on_event=lambda e: (view.apply(e), go_down(e)))
    sim.set_down(None)
    client.close()
    assert result.finish_reason == "disconnected"
    assert 5 <= result.num_verified < len(result.token_ids) <= 40
    assert result.token_ids[: result.num_verified] == expected[: result.num_verified]
    unverified = len(result.token_ids) - result.num_verified
    assert result.verified_mask == [True] * result.num_verified + [False] * unverified
    assert view.tokens == result.token_ids and view.num_verified == result.num_verified


def test_trained_demo_drafter_survives_cuts_and_its_offline_drafts_are_confirmed():
    """The shipped demo target and MoA drafter (real acceptance), cut at random points, pipelined
    rounds in flight among them: exact, and many of the tokens drafted offline are confirmed by
    the target after the resync."""
    import json

    from transformers import AutoTokenizer

    from vllm_moa.models import load_drafter
    from vllm_moa.shipped import SHIPPED
    from vllm_moa.target import TargetModel

    target = TargetModel.from_pretrained(SHIPPED / "target")
    target.name = json.loads((SHIPPED / "moa-tli0" / "config.json").read_text())["target"]["name"]
    drafter = load_drafter(SHIPPED / "moa-tli0", target).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED / "target"))
    prompts = [p["text"] for p in json.loads((SHIPPED / "heldout_prompts.json").read_text())][:4]
    rng = random.Random(11)
    confirmed = offline = pipelined = 0
    with running_server(target, {"moa-tli0": drafter}) as (url, app, backend):
        with NetSim(int(url.rsplit(":", 1)[1]), LinkConditions(rtt_ms=2.0), seed=1) as sim:
            for trial, text in enumerate(prompts):
                ids = tokenizer(text)["input_ids"][-48:]
                expected = plain_greedy_generate(target, ids, 48).token_ids
                sim.cut_after_bytes(rng.randrange(30_000, 50_000), then="refuse", connections=rng.randrange(1, 4))
                client = RemoteDraftingClient(sim.url, drafter, target, timeout=0.5, backoff_s=0.05,
                                              backoff_max_s=0.2, num_draft=4, offline_chunk=4)
                view = Transcript()
                result = client.generate(ids, 48, on_event=view.apply)
                client.close()
                sim.disarm()
                _check(result, view, expected, dict(trial=trial))
                confirmed += result.offline_confirmed
                offline += result.offline_tokens
                pipelined += result.pipelined_rounds
    assert offline > 0 and confirmed > 0, (offline, confirmed)
    assert pipelined > 0  # cut with rounds in flight too (pipeline.py)


def test_netsim_keeps_every_byte_in_order_under_loss_and_stays_on_loopback():
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def echo() -> None:
        conn, _ = listener.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    payload = random.Random(0).randbytes(300_000)
    conditions = LinkConditions(rtt_ms=1.0, bandwidth_mbit=400.0, loss=0.3, rto_ms=2.0, jitter_ms=1.0)
    with NetSim(port, conditions, seed=5) as sim:
        with socket.create_connection(("127.0.0.1", sim.listen_port)) as client:
            sender = threading.Thread(target=client.sendall, args=(payload,))
            sender.start()
            received = bytearray()
            while len(received) < len(payload):
                chunk = client.recv(65536)
                assert chunk, "proxy closed the connection"
                received += chunk
            sender.join()
        stats = sim.snapshot()
    listener.close()
    assert bytes(received) == payload
    assert stats.lost_chunks > 0 and stats.bytes_up == stats.bytes_down == len(payload)
    for host in ("10.1.2.3", "0.0.0.0", "example.com"):
        with pytest.raises(ValueError, match="loopback"):
            NetSim(port, host=host)
