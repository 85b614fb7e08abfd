"""The checkout's kernels/ (installed as vllm_moa.kernels) never shadows Hugging Face's `kernels`
package when the checkout's root is on sys.path (pytest's pythonpath, `python -m` from the
checkout): transformers 5.2x imports that package at import where it is installed (vLLM 0.26's GPU
pack carries it), and failed on our folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _imported_kernels(site: Path | None) -> str:
    """What `import kernels` loads in a fresh interpreter run from the checkout's root."""
    env = {**os.environ, "PYTHONPATH": str(site) if site else ""}
    script = "import kernels; print(kernels.__file__); print(getattr(kernels, 'CUDAProperties', None))"
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _hub_kernels(site: Path) -> Path:
    """A `kernels` distribution installed in `site` (its package and its dist-info), as pip leaves one."""
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("CUDAProperties = 'the hub package'\n")
    info = site / "kernels-0.19.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    return site


def test_an_installed_hub_kernels_package_is_what_import_kernels_loads(tmp_path):
    out = _imported_kernels(_hub_kernels(tmp_path / "site")).splitlines()
    assert out == [str(tmp_path / "site" / "kernels" / "__init__.py"), "the hub package"]


def test_without_it_the_checkouts_folder_imports_as_itself(tmp_path):
    out = _imported_kernels(None).splitlines()
    assert out == [str(REPO / "kernels" / "__init__.py"), "None"]
