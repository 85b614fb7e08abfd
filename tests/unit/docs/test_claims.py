"""README.md's headline numbers against their results files (docs/claims.toml): every claim reads
the same from its file as the README prints it, in a row that names that file (in its "what" or
"number" cell); every number of
the table's "number" column is claimed; the README stays short. The last tests show the check
catching a README number that drifts and a results file that changes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python >= 3.11's")  # docs/claims.toml
ROOT = Path(__file__).resolve().parents[3]
NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?x?(?![\w.])")


def select(data: Any, path: list) -> Any:
    """A value inside a results file: keys, list indices, or {field: value} for the one element of
    a list whose fields match."""
    for step in path:
        if isinstance(step, dict):
            matches = [item for item in data if all(item.get(k) == v for k, v in step.items())]
            if len(matches) != 1:
                raise LookupError(f"{step} matches {len(matches)} elements, not one")
            data = matches[0]
        else:
            data = data[step]
    return data


def headline_rows(readme: str) -> list[list[str]]:
    """The headline table's rows as [what, number, results file] cells."""
    section = readme.split("## Headline numbers", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")]
    return [row for row in rows[2:] if len(row) == 3]  # after the header and its rule


def check(readme: str, claims: list[dict], load=lambda file: json.loads((ROOT / file).read_text())) -> list[str]:
    """What does not hold (empty: every claim and the table's coverage hold)."""
    problems, rows = [], headline_rows(readme)
    for claim in claims:
        try:
            value = claim["format"].format(select(load(claim["file"]), claim["select"]))
        except (LookupError, KeyError, TypeError, ValueError) as err:
            problems.append(f"{claim['text']} ({claim['file']}): {err!r}")
            continue
        if value != claim["text"]:
            problems.append(f"{claim['file']} {claim['select']} reads {value}, the README says {claim['text']}")
        named = [row for row in rows if Path(claim["file"]).name in row[2]]
        if not any(claim["text"] in NUMBER.findall(f"{row[0]} {row[1]}") for row in named):
            problems.append(f"no headline row naming {Path(claim['file']).name} prints {claim['text']}")
    for what, number, source in rows:
        claimed = {c["text"] for c in claims if Path(c["file"]).name in source}
        for text in NUMBER.findall(number):
            if text not in claimed:
                problems.append(f"row {what!r}: {text} is not claimed from the file it names ({source})")
    return problems


def claims() -> list[dict]:
    return tomllib.loads((ROOT / "docs" / "claims.toml").read_text())["claim"]


def test_every_headline_number_reads_the_same_from_its_results_file():
    assert check((ROOT / "README.md").read_text(), claims()) == []


def test_the_readme_is_short_and_its_cells_too():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    cells = [cell for line in readme.splitlines() if line.startswith("|") for cell in line.split("|")]
    assert max(len(cell) for cell in cells) <= 300
    assert 1 <= len(headline_rows(readme)) <= 10


def test_a_readme_number_that_drifts_is_caught():
    readme = (ROOT / "README.md").read_text()
    drifted = readme.replace("**1.46x** / **1.26x** / 0.97x", "**1.81x** / **1.26x** / 0.97x", 1)
    assert drifted != readme
    problems = check(drifted, claims())
    assert any("1.81x is not claimed" in p for p in problems) and any("prints 1.46x" in p for p in problems)


def test_a_results_file_that_changes_is_caught():
    def load(file):
        data = json.loads((ROOT / file).read_text())
        if file.endswith("vllm_serve_load_smollm2.json"):
            data["summary"]["status_5xx"] = 3
        return data

    problems = check((ROOT / "README.md").read_text(), claims(), load)
    assert problems == ["benchmarks/results/vllm_serve_load_smollm2.json ['summary', 'status_5xx'] reads 3, "
                        "the README says 0"]
