"""Recorded clients replayed by many users (benchmarks/client_replay.py, the server-capacity
benchmark's users): against a real server on 127.0.0.1, a recorded MoA client run replays on fresh
sessions with the very answers it got, the users' tokens add up, and the recorded drafting waits
are kept."""

import pytest
from serving_utils import running_server, tiny_drafters
from tiny_models import make_target

from benchmarks.client_replay import Recording, Round, describe, gaps_of, record_run, replay_users
from vllm_moa.decoding.chain import plain_greedy_generate
from vllm_moa.serving.client import RemoteDraftingClient

PROMPTS = ([11, 12, 13, 14, 15, 11, 12], [21, 22, 23, 24, 21, 22])
TOKENS = 24


def test_a_recorded_client_replays_with_the_answers_it_got_from_many_users():
    target = make_target("qwen2")
    drafters = tiny_drafters(target)
    with running_server(target, drafters) as (url, app, _backend):
        with RemoteDraftingClient(url, drafters["moa-tli0"], target, num_draft=3) as client:
            recordings = [record_run(client, prompt, TOKENS) for prompt in PROMPTS]
        for prompt, recording in zip(PROMPTS, recordings):
            assert recording.token_ids == plain_greedy_generate(target, prompt, TOKENS).token_ids
            assert len(recording.rounds) >= 2 and recording.open_body["prompt"] == prompt
        recordings[0].rounds[1].wait_s = 0.3  # a slow drafting step: the replay waits it out
        outcome = replay_users(url, recordings, users=3)
        assert outcome["errors"] == [] and outcome["diverged"] == []
        assert outcome["tokens"] == 3 * TOKENS
        deliveries = outcome["deliveries"][0]  # the open's first token, then one per round
        assert deliveries[2][0] - deliveries[1][0] >= 0.3
        assert sum(count for _, count in deliveries) == TOKENS
        assert len(app.state.store) == 0  # every replayed session closed

        recordings[1].rounds[-1].accepted = [*recordings[1].rounds[-1].accepted, 0]  # an answer it did not get
        outcome = replay_users(url, recordings, users=2)
        assert outcome["diverged"] == [{"user": 1, "round": len(recordings[1].rounds)}]
        assert outcome["tokens"] < 2 * TOKENS


def test_gaps_spread_a_delivery_over_its_tokens_and_leave_out_the_first():
    assert gaps_of([(1.0, 1), (1.3, 3), (1.5, 1)]) == pytest.approx([0.1, 0.1, 0.1, 0.2])
    assert gaps_of([(1.0, 1)]) == []


def test_the_share_of_rounds_accepted_to_their_full_depth():
    chain = {"seq": 5, "tree": {"tokens": [1, 2, 3, 4], "parents": [-1, 0, 1, 2]}}
    tree = {"seq": 9, "tree": {"tokens": [1, 2, 3, 4], "parents": [-1, 0, 0, 1]}}  # depth 2
    alone = {"seq": 9, "tree": {"tokens": [1], "parents": [-1]}}  # nothing drafted: not counted
    rounds = [Round(0.0, chain, [2, 3, 4], 7), Round(0.0, chain, [2], 7), Round(0.0, tree, [2, 4], 7),
              Round(0.0, alone, [], 7)]
    recording = Recording([1], 8, {}, 1, rounds, [])
    assert describe([recording])["fully_accepted_share"] == round(2 / 3, 3)
