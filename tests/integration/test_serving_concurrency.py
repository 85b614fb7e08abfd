"""34 sessions at once on one server stay isolated: each client, with its own prompt, drafter
and draft shape, gets exactly its own target greedy output, while the server interleaves their
verifications (one target forward at a time)."""

import threading

from serving_utils import DRAFTER_KINDS, running_server, tiny_drafters
from tiny_models import make_target

from vllm_moa.decoding.chain import plain_greedy_generate
from vllm_moa.serving.client import RemoteDraftingClient, Transcript
from vllm_moa.serving.protocol import ServerLimits

CLIENTS = 40  # every 6th is an API-baseline client (no session): 34 sessions


def test_concurrent_sessions_are_isolated():
    target = make_target("llama", seed=4)
    drafters = tiny_drafters(target)
    prompts = [[(7 * i + j) % target.vocab_size for j in range(3 + i % 9)] for i in range(CLIENTS)]
    lengths = [12 + (i % 5) * 4 for i in range(CLIENTS)]
    expected = [plain_greedy_generate(target, p, n).token_ids for p, n in zip(prompts, lengths)]
    assert len({tuple(e) for e in expected}) > CLIENTS // 2  # the outputs differ: mixing would show
    results: list = [None] * CLIENTS
    errors: list = []
    open_at_once: list[int] = []
    opened = threading.Barrier(CLIENTS, action=lambda: open_at_once.append(len(app.state.store)))

    limits = ServerLimits(max_sessions=CLIENTS, max_sessions_per_client=CLIENTS,
                          max_generations_per_client=CLIENTS)  # all clients share one address here
    with running_server(target, drafters, limits) as (url, app, backend):
        def run(i: int) -> None:
            try:
                kind = (*DRAFTER_KINDS, None)[i % (len(DRAFTER_KINDS) + 1)]
                drafter = None if kind is None else drafters[kind]
                with RemoteDraftingClient(url, drafter, target, num_draft=1 + i % 4,
                                          tree_top_k=2 if i % 3 == 0 else None) as client:
                    view = Transcript()
                    waited = False
                    for event in client.stream(prompts[i], lengths[i]):
                        view.apply(event)
                        if not waited and event.kind == "verified":  # every session is open at once
                            waited = True
                            opened.wait(timeout=120)
                        if event.kind == "done":
                            results[i] = (event.result, view.tokens)
            except Exception as err:  # noqa: BLE001 - reported below with the session's index
                errors.append((i, repr(err)))
                opened.abort()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not errors, errors
        assert open_at_once and open_at_once[0] >= 32, open_at_once
        for i, (result, streamed) in enumerate(results):
            assert result.token_ids == expected[i] == streamed, i
            assert result.num_verified == lengths[i]
        assert len(app.state.store) == 0  # every session was closed
        assert backend.counters["opens"] == open_at_once[0]
