"""The numbers README.md and docs/ attribute to results files, against those files (docs/history.md,
a dated log, excepted: its numbers are those of their moment).

A block of the document (a paragraph, a list item, a table) attributes its numbers to the results
files it names (`name.json`, `name.{json,png}`, with or without `benchmarks/results/`) and to those
named before it in its section. Every number such a block prints must be one
of those files' values at the printed precision (as is, or as a percentage, milliseconds, MiB,
thousands, millions, KiB or MiB), or be listed in the block's `<!-- unchecked: n n: why -->` comment:
derived figures, hand timings, facts about a model. Numbers inside backticks (commands, paths),
commits, dates and issue numbers are not results. The last tests show the check catching a number
changed in the document and a value changed in its file."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "benchmarks" / "results"
DOCUMENT = ROOT / "docs" / "results.md"
DOCUMENTS = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "history.md")
RESULTS_FILE = re.compile(r"([\w-]+)\.(?:json|\{json, ?png\})")
ALTERNATIVES = re.compile(r"([\w-]*)\{([\w-]*(?:, ?[\w-]*)+)\}([\w-]*)(?=\.(?:json|\{json))")  # a{,_b}.json
UNCHECKED = re.compile(r"<!--\s*unchecked:\s*(.*?)-->", re.S)
NOT_RESULTS = [
    re.compile(r"`[^`]*`"),                          # commands, paths, code
    re.compile(r"<!--.*?-->", re.S),                 # comments (the unchecked lists among them)
    re.compile(r"\]\([^)]*\)"),                      # link targets
    re.compile(r"\b(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),  # commits
    re.compile(r"\bcommit \d{7,40}\b"),                  # commits of digits only
    re.compile(r"\b\d{4}-\d{2}-\d{2}\b"),            # dates
    re.compile(r"\b(?:[Ii]ssues?|PR|#)\s*\d+(?:\s*(?:and|,)\s*\d+)*"),
    re.compile(r"[\w./-]*[\w-]+\.(?:json|png|py|md|\{json, ?png\})"),
]
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:e-?\d+)?(?=x?(?![\w]))")  # 1.83x reads 1.83
SCALES = (1.0, 100.0, 1e3, 1e-3, 1e-6, 1 / 2**10, 1 / 2**20)  # as is, %, ms, thousands, millions, KiB, MiB


def file_values(data) -> list[float]:
    """Every number in a results file: numeric leaves and the numbers inside its strings."""
    if isinstance(data, dict):
        return [v for item in data.values() for v in file_values(item)]
    if isinstance(data, list):
        return [v for item in data for v in file_values(item)]
    if isinstance(data, bool) or data is None:
        return []
    if isinstance(data, (int, float)):
        return [float(data)]
    return [float(n) for n in re.findall(r"\d+(?:\.\d+)?", str(data))]


@cache
def values_of(name: str) -> tuple[float, ...] | None:
    path = RESULTS / f"{name}.json"
    return tuple(file_values(json.loads(path.read_text()))) if path.exists() else None


def printed_as(text: str, values) -> bool:
    """Whether one of `values`, at some scale, rounds to `text` at its precision (half a unit of its
    last digit, either rounding of a tie; sign ignored)."""
    digits = text.replace(",", "").lstrip("+-")
    mantissa, _, exponent = digits.partition("e")
    half_unit = 0.5 * 10.0 ** (int(exponent or 0) - len(mantissa.partition(".")[2])) * (1 + 1e-9)
    target = float(digits)
    return any(abs(abs(value) * scale - target) <= half_unit for value in values for scale in SCALES)


def blocks(markdown: str):
    """(section heading, block text) for each block that is not a heading."""
    heading = ""
    for block in re.split(r"\n\s*\n", markdown):
        if block.lstrip().startswith("#"):
            heading = block.strip().splitlines()[0]
            continue
        yield heading, block


def unchecked_in(block: str) -> set[str]:
    """The numbers a block's `<!-- unchecked: n n: why -->` comments list."""
    return {n.lstrip("+-") for listed in UNCHECKED.findall(block)
            for n in NUMBER.findall(listed.split(": ", 1)[0])}


def printed_numbers(block: str) -> list[str]:
    """The numbers a block prints as results (not in commands, paths, commits, dates, comments)."""
    for pattern in NOT_RESULTS:
        block = pattern.sub(" ", block)
    return NUMBER.findall(block)


def named_files(block: str) -> list[str]:
    """The results files a block names, `a_{b,c}.json` read as a_b.json and a_c.json (`a{,_b}.json`:
    a.json and a_b.json)."""
    expanded = ALTERNATIVES.sub(lambda m: " ".join(f"{m[1]}{alt.strip()}{m[3]}.json" for alt in m[2].split(","))
                                + " ", block)
    return RESULTS_FILE.findall(expanded)


def attributed(markdown: str, values=values_of):
    """(number, its files, its block) for each number a block prints; files empty where none is
    named in the block or before it in its section."""
    section, files = None, []
    for heading, block in blocks(markdown):
        if heading != section:
            section, files = heading, []
        named = [name for name in named_files(block) if values(name) is not None]
        files = list(dict.fromkeys(files + named))
        for text in printed_numbers(block):
            yield text, files, block


def unmatched(markdown: str, values=values_of) -> list[str]:
    """'number (files): block start' for each attributed number its files do not hold."""
    problems = []
    for text, files, block in attributed(markdown, values):
        if files and text.lstrip("+-") not in unchecked_in(block) and \
                not printed_as(text, [v for name in files for v in values(name)]):
            problems.append(f"{text} ({', '.join(files)}): {' '.join(block.split())[:90]}")
    return problems


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_attributed_number_is_in_its_results_file(document):
    problems = unmatched(document.read_text())
    assert not problems, f"{document.name} prints numbers its results files do not hold:\n" + "\n".join(problems)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_unchecked_number_is_printed_in_its_block(document):
    """An `unchecked` list names numbers its own block prints (no stale exemptions)."""
    stale = [(n, block[:60]) for _, block in blocks(document.read_text())
             for n in unchecked_in(block) - {p.lstrip("+-") for p in printed_numbers(block)}]
    assert not stale, f"unchecked numbers their block does not print: {stale}"


def test_the_check_covers_the_document():
    """Nine in ten of the document's numbers are attributed to a file, so a section cannot slip out
    of the check unnoticed."""
    numbers = list(attributed(DOCUMENT.read_text()))
    share = sum(1 for _, files, _ in numbers if files) / len(numbers)
    assert len(numbers) > 800 and share >= 0.9, (len(numbers), share)


def test_a_number_changed_in_the_document_is_caught():
    block = "No speculation at 16: 205.7 tokens/s (`x`, vllm_cpu_engine_smollm2_defaults.json)."
    assert not unmatched(block)
    assert unmatched(block.replace("205.7", "205.2"))


def test_a_value_changed_in_the_results_file_is_caught():
    block = "No speculation at 16: 205.7 tokens/s (vllm_cpu_engine_smollm2_defaults.json)."
    changed = [v + 0.5 if round(v, 1) == 205.7 else v for v in values_of("vllm_cpu_engine_smollm2_defaults")]
    assert unmatched(block, values=lambda name: changed)
    assert not unmatched(block + " <!-- unchecked: 205.7: by hand -->", values=lambda name: changed)
