"""VLLM_MOA_ENGINE_SPIN_MS as the client-server backend sets it for its engine
(integration/shell/queue_spin.py); the patch on vLLM's own SpinCondition is tested in
tests/integration/vllm/test_vllm_patches.py, the idle engine in test_vllm_serving_backend.py."""

from __future__ import annotations

import os

import pytest

from vllm_moa import envs
from vllm_moa.integration.shell.queue_spin import SPIN_ENV, engine_spin


def test_the_engine_s_spin_is_set_while_it_starts_then_gone(monkeypatch):
    monkeypatch.delenv(SPIN_ENV, raising=False)
    with engine_spin(2.0) as spin:
        assert spin == 2.0 and os.environ[SPIN_ENV] == "2" and envs.VLLM_MOA_ENGINE_SPIN_MS == 2.0
    assert SPIN_ENV not in os.environ and envs.VLLM_MOA_ENGINE_SPIN_MS is None


def test_a_spin_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv(SPIN_ENV, "1000")
    with engine_spin(2.0) as spin:
        assert spin == 1000.0 and os.environ[SPIN_ENV] == "1000"
    assert os.environ[SPIN_ENV] == "1000"


@pytest.mark.parametrize("value", ["fast", "-1", "nan", "inf"])
def test_a_bad_spin_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(SPIN_ENV, value)
    with pytest.raises(ValueError, match=f"{SPIN_ENV} must be a number of milliseconds >= 0, got '{value}'"):
        with engine_spin(2.0):
            pass
