"""The wheel installs `vllm_moa` (kernels mapped to `vllm_moa.kernels`), never a top-level
`kernels` package, and keeps vLLM and Ray out of the core requirements."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_layout_and_requirements(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, timeout=600)
    wheel = next(tmp_path.glob("vllm_moa-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names}
    assert not {"kernels", "tests", "benchmarks"} & top_level, sorted(top_level)
    assert "vllm_moa/kinds/moa/model.py" in names
    if (ROOT / "kernels" / "__init__.py").exists():
        assert "vllm_moa/kernels/__init__.py" in names
    for shipped in (ROOT / "vllm_moa" / "assets").rglob("*"):
        if shipped.is_file():
            assert shipped.relative_to(ROOT).as_posix() in names, shipped
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    core = [r for r in requires if "extra ==" not in r]
    assert not any("vllm" in r or "ray" in r for r in core), core
    assert any("extra == \"vllm\"" in r for r in requires) and any("extra == \"ray\"" in r for r in requires)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "vllm-moa = vllm_moa.cli:app" in entry_points
