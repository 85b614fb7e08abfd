"""docs/architecture.md lists every module of the package and of kernels/, by path, and names no
module that does not exist (a new module without its line, or a moved one, fails here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def modules() -> set[str]:
    """Module paths as the doc writes them: under vllm_moa/ without the prefix, kernels/ with it."""
    found = {str(p.relative_to(ROOT / "vllm_moa")) for p in (ROOT / "vllm_moa").rglob("*.py")}
    found |= {str(p.relative_to(ROOT)) for p in (ROOT / "kernels").rglob("*.py")}
    return {m for m in found if not m.endswith("__init__.py") and "/assets/" not in f"/{m}"}


def listed(doc: str) -> set[str]:
    code_map = doc.split("```", 2)[1]  # the first code block: the code map
    return set(re.findall(r"(?<![\w/.])((?:[a-z_]+/)*[a-z_0-9]+\.py)\b", code_map))


def test_every_module_is_in_the_code_map():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = sorted(modules() - listed(doc))
    assert not missing, f"docs/architecture.md's code map lacks {missing}"


def test_the_code_map_names_only_modules_that_exist():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    stale = sorted(listed(doc) - modules())
    assert not stale, f"docs/architecture.md's code map names modules that do not exist: {stale}"


def test_the_check_sees_a_missing_module():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert "integration/moa/proposer.py" in listed(doc)
    assert "integration/moa/proposer.py" not in listed(doc.replace("integration/moa/proposer.py", "proposer"))
