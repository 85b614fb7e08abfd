"""What this CPU can do natively, read from its flags (Linux /proc/cpuinfo): our machines differ
(some AVX2 only, some AVX-512 with bf16 dot products, some AMX), and bf16 pays only where the
hardware computes it (elsewhere it is emulated and slower than fp32)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # native bf16 matrix arithmetic
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # int8 dot products into int32 (VNNI)
# oneDNN's bf16 matmul in PyTorch's CPU build refuses to run without one of these ("bf16 path needs
# the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"): AVX2-only CPUs have neither
ONEDNN_BF16_FLAG_SETS = (("avx_ne_convert",), ("avx512bw", "avx512vl", "avx512dq"))


@cache
def cpu_flags() -> frozenset[str]:
    """The ISA flags of the first CPU ("avx2", "avx512f", "avx512_bf16", "amx_bf16", ...); empty
    where /proc/cpuinfo is unavailable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX-512 BF16 or AMX)."""
    return any(flag in cpu_flags() for flag in BF16_FLAGS)


def onednn_bf16() -> bool:
    """Whether PyTorch's oneDNN runs bf16 matmuls on this CPU at all (natively or emulated)."""
    return any(all(flag in cpu_flags() for flag in flags) for flags in ONEDNN_BF16_FLAG_SETS)


def native_int8_dot() -> bool:
    """Whether the CPU accumulates int8 dot products into int32 in one instruction (VNNI or AMX)."""
    return any(flag in cpu_flags() for flag in INT8_DOT_FLAGS)


def isa_summary() -> dict[str, bool]:
    """The flags that choose code paths here, for results files' provenance."""
    return {flag: flag in cpu_flags() for flag in ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_tile")}
