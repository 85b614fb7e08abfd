"""vllm_moa/envs.py: every variable the package reads, parsed once, read when accessed."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_moa import envs
from vllm_moa.targets import cache_root


@pytest.mark.parametrize(("value", "expected"), [(None, None), ("", None), ("1", True), ("yes", True),
                                                 ("0", False), ("off", False), ("FALSE", False)])
def test_fix_cpu_sampler_is_three_state(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("VLLM_MOA_FIX_CPU_SAMPLER", raising=False)
    else:
        monkeypatch.setenv("VLLM_MOA_FIX_CPU_SAMPLER", value)
    assert envs.VLLM_MOA_FIX_CPU_SAMPLER is expected


def test_values_are_read_when_accessed(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_MOA_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert envs.VLLM_MOA_CACHE == tmp_path / "xdg" / "vllm-moa" == cache_root()
    monkeypatch.setenv("VLLM_MOA_CACHE", str(tmp_path / "mine"))
    assert envs.VLLM_MOA_CACHE == Path(tmp_path / "mine") == cache_root()
    monkeypatch.setenv("VLLM_MOA_PLUGIN", "0")
    assert envs.VLLM_MOA_PLUGIN is False
    monkeypatch.setenv("VLLM_MOA_TOKEN", " abcdefgh, ,ijklmnop ")
    assert envs.VLLM_MOA_TOKEN == ["abcdefgh", "ijklmnop"]


def test_every_variable_is_documented_and_unknown_names_fail():
    for name in envs.environment_variables:
        assert name in envs.__doc__
    assert sorted(dir(envs)) == sorted(envs.environment_variables)
    with pytest.raises(AttributeError, match="VLLM_MOA_NOPE"):
        envs.VLLM_MOA_NOPE  # noqa: B018
