"""The repository's kernels/ must not shadow Hugging Face's `kernels` package.

This folder is installed as `vllm_moa.kernels`, but a process whose sys.path holds the checkout's
root (pytest's `pythonpath = ["."]`, `python -m benchmarks...` run from the checkout) finds it as a
top-level `kernels` first. transformers (5.2x: `integrations.hub_kernels`, imported by
`modeling_utils`) and vLLM import Hugging Face's `kernels` by that name where its distribution is
installed (vLLM 0.26's GPU pack carries kernels 0.19.1), and failed on this folder:
"cannot import name 'CUDAProperties' from 'kernels'".
"""

from __future__ import annotations

import sys
from importlib import machinery, metadata, util
from pathlib import Path


def hand_over(init_file: str) -> bool:
    """Called by kernels/__init__.py when imported as top-level `kernels`: where Hugging Face's
    `kernels` distribution is installed, load that package from sys.path without this folder's
    parent, put it in sys.modules["kernels"] (what the import statement returns) and answer True;
    else False (this folder is the only `kernels` here, and imports as itself)."""
    try:
        metadata.distribution("kernels")
    except metadata.PackageNotFoundError:
        return False
    ours = Path(init_file).resolve().parent
    path = [entry for entry in sys.path if (Path(entry or ".").resolve() / "kernels") != ours]
    spec = machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None or Path(spec.origin or "").resolve().parent == ours:
        return False
    module = util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["kernels"]
        raise
    sys.modules.pop("kernels._shadow", None)  # this module, loaded under the name handed over
    return True
