"""The vLLM backend's live sessions (integration/serve/live_sessions.py), without an engine: at
most `max_sessions` resumable requests holding at most `max_tokens` tokens; room is made by ending
the least recently used idle ones, never one whose round is in flight. The engine itself:
tests/integration/vllm/test_vllm_live_sessions.py."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_moa.integration.serve.live_sessions import LiveSessions


def _sessions(n):
    return [SimpleNamespace(live=None) for _ in range(n)]


def test_a_session_keeps_its_live_request_round_after_round():
    ended = []
    live = LiveSessions(ended.append, max_sessions=2, max_tokens=1000)
    (a,) = _sessions(1)
    first = live.claim(a, 10)
    assert first is not None and first.busy and not first.started and a.live is first
    live.release(first, 10)
    again = live.claim(a, 14)
    assert again is first and again.started and again.valid == 10
    live.release(again, 13)
    assert live.held() == (1, 13) and ended == []


def test_the_least_recently_used_idle_session_gives_way_and_a_busy_one_never_does():
    ended = []
    live = LiveSessions(ended.append, max_sessions=2, max_tokens=1000)
    a, b, c = _sessions(3)
    la, lb = live.claim(a, 5), live.claim(b, 5)
    live.release(la, 5)  # a idle (least recently used); b's round still in flight
    lc = live.claim(c, 5)
    assert lc is not None and ended == [la.external] and la.ended and not lb.ended
    live.release(lc, 5)
    assert live.claim(a, 5) is not la and ended == [la.external, lc.external]  # a starts anew; c gave way
    d = _sessions(1)[0]
    assert live.claim(d, 5) is None  # a and b busy: no room, the round runs as a request
    assert live.held()[0] == 2


def test_the_token_bound_ends_idle_sessions_first():
    ended = []
    live = LiveSessions(ended.append, max_sessions=8, max_tokens=100)
    a, b, c = _sessions(3)
    for session, n in ((a, 40), (b, 40)):
        live.release(live.claim(session, n), n)
    assert live.claim(c, 30) is not None and ended == [a.live.external]  # 40 + 40 + 30 > 100
    assert live.held() == (2, 40)  # b, and c not yet released (0 valid)


def test_ending_a_session_frees_it_once_and_a_forgotten_one_is_not_ended_again():
    ended = []
    live = LiveSessions(ended.append, max_sessions=4, max_tokens=1000)
    a, b = _sessions(2)
    la, lb = live.claim(a, 5), live.claim(b, 5)
    live.end(la)
    live.end(la)
    live.end(None)  # a session that never had one
    live.forget(lb)  # vLLM ended it itself
    live.end(lb)
    assert ended == [la.external] and live.held() == (0, 0)
    assert live.claim(a, 5) is not la  # an ended request is never reused
