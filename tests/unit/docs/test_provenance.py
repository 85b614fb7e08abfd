"""Provenance of results files (benchmarks/provenance.py): untracked files make a tree dirty (results
files that benchmarks write do not), a git
that cannot answer is recorded as unknown (never as clean), and every committed results file
records its commit whole, a commit this repository has."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks.provenance import ROOT, git, uncommitted_changes


def test_untracked_files_count_and_a_failing_git_is_unknown(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    for args in (["init", "-q"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"]):
        subprocess.run(["git", *args], cwd=repo, check=True)
    assert uncommitted_changes(repo) is False
    (repo / "benchmarks" / "results").mkdir(parents=True)
    (repo / "benchmarks" / "results" / "run.json").write_text("{}")  # a benchmark's output: still clean
    assert uncommitted_changes(repo) is False
    git_ = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git_, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git_, "commit", "-q", "-m", "results"], cwd=repo, check=True)
    (repo / "benchmarks" / "results" / "run.json").write_text('{"again": 1}')  # " M ..." listed first
    assert uncommitted_changes(repo) is False
    (repo / "new.txt").write_text("untracked")
    assert uncommitted_changes(repo) is True
    outside = tmp_path / "not-a-repo"
    outside.mkdir()
    assert git("rev-parse", "HEAD", root=outside) is None and uncommitted_changes(outside) is None


def test_results_files_record_whole_commits_that_exist():
    if git("rev-parse", "--is-shallow-repository") != "false":
        pytest.skip("a shallow clone (or no git): older commits cannot be looked up")
    recorded = {}
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        data = json.loads(path.read_text())
        commit = data.get("provenance", {}).get("commit") if isinstance(data, dict) else None
        if commit is not None:
            recorded[path.name] = commit
    assert len(recorded) > 50
    for name, commit in recorded.items():
        assert isinstance(commit, str) and len(commit) == 40, f"{name}: commit {commit!r} is not whole"
        assert git("cat-file", "-e", f"{commit}^{{commit}}") is not None, f"{name}: commit {commit} is not in this repository"


def test_the_openmp_runtime_and_ld_preload_are_recorded():
    """Speed on CPU depends on which OpenMP runtime runs torch's threads (vLLM's CPU worker warns
    that speculative decoding loses without Intel's preloaded): a run in a child that preloads
    libgomp explicitly records it, and LD_PRELOAD as given."""
    import sys

    import torch

    gomp = next((p for p in (Path(torch.__file__).parent / "lib").glob("libgomp*.so*")), None) or \
        next(iter(Path("/usr/lib/x86_64-linux-gnu").glob("libgomp.so*")), None)
    if gomp is None or not Path("/proc/self/maps").exists():
        pytest.skip("no libgomp to preload, or no /proc")
    code = ("import json, torch; from benchmarks.provenance import provenance; p = provenance(); "
            "print(json.dumps([p['ld_preload'], p['openmp']]))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LD_PRELOAD": str(gomp)}, check=True)
    ld_preload, runtimes = json.loads(run.stdout.strip().splitlines()[-1])
    assert ld_preload == str(gomp) and gomp.resolve().name in runtimes, (ld_preload, runtimes)  # maps names files
