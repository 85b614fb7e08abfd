"""The import layers of pyproject.toml's import-linter contracts (docs/architecture.md): the
package as it is keeps them, and a lower layer that imports a higher one (here inside a function,
which counts as much) or a cycle between two modules breaks them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytest.importorskip("importlinter")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.exit(lint_imports_command())"], cwd=root, capture_output=True, text=True)


def _python_copy(tmp_path: Path) -> Path:
    """The package's and kernels' Python files and pyproject.toml, in a fresh directory."""
    for package in ("vllm_moa", "kernels", "benchmarks"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("assets", "data", "results", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_package_keeps_its_layers():
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


@pytest.mark.parametrize(("module", "probe", "broken"), [
    ("vllm_moa/models/base.py", "from vllm_moa.kinds import moa", "vllm_moa.models is not allowed to import vllm_moa.kinds"),
    ("vllm_moa/config.py", "from vllm_moa.serving import protocol", "vllm_moa.config is not allowed to import vllm_moa.serving"),
    ("vllm_moa/integration/moa/tree_verification.py", "from vllm_moa.integration.moa import tree_drafts",
     "no cycles among the modules"),
    # integration's wings: the shell names the proposer by string and never imports the moa wing
    ("vllm_moa/integration/shell/patches.py", "from vllm_moa.integration.moa import proposer",
     "vllm_moa.integration.shell is not allowed to import vllm_moa.integration.moa"),
    ("vllm_moa/integration/moa/draft_model.py", "from vllm_moa.integration.serve import offline",
     "vllm_moa.integration.moa is not allowed to import vllm_moa.integration.serve"),
    ("kernels/paged.py", "from vllm_moa import registry", "kernels stand alone"),
    ("benchmarks/load_recorder.py", "from benchmarks import server_load", "no cycles among the modules"),
    ("vllm_moa/shipped.py", "from benchmarks import provenance", "the package never imports its benchmarks"),
])
def test_an_upward_import_or_a_cycle_breaks_them(tmp_path, module, probe, broken):
    root = _python_copy(tmp_path)
    with open(root / module, "a") as source:
        source.write(f"\n\ndef _probe():\n    {probe}  # noqa: F401\n")
    run = lint_imports(root)
    assert run.returncode != 0
    assert broken in run.stdout.split("Broken contracts")[-1]
