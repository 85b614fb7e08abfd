"""Tensor parallelism as the plugin's configuration sees it (docs/sharded-targets.md): the heads
each rank holds, the drafter's TP options (VLLM_MOA_TP_DRAFTER_MLP, VLLM_MOA_TP_TAP_DTYPE) and why
a drafter cannot run at a given size. Pure arithmetic, tested without vLLM; `tp_size` asks vLLM's
parallel state (imported when called). The tap's collectives: integration/moa/tensor_parallel.py.
"""

from __future__ import annotations

from vllm_moa import envs

DRAFTER_MLPS = ("sharded", "replicated")  # VLLM_MOA_TP_DRAFTER_MLP
TAP_DTYPES = ("auto", "fp8")  # VLLM_MOA_TP_TAP_DTYPE


def tp_options() -> tuple[str, str]:
    """(VLLM_MOA_TP_DRAFTER_MLP, VLLM_MOA_TP_TAP_DTYPE), checked: a ValueError names a bad value."""
    mlp, tap = envs.VLLM_MOA_TP_DRAFTER_MLP, envs.VLLM_MOA_TP_TAP_DTYPE
    if mlp not in DRAFTER_MLPS:
        raise ValueError(f"VLLM_MOA_TP_DRAFTER_MLP={mlp!r}: expected one of {list(DRAFTER_MLPS)}")
    if tap not in TAP_DTYPES:
        raise ValueError(f"VLLM_MOA_TP_TAP_DTYPE={tap!r}: expected one of {list(TAP_DTYPES)}")
    return mlp, tap


def local_heads(total: int, tp_size: int, what: str) -> int:
    """Heads of one rank when `total` heads are split `tp_size` ways (attention heads must divide)."""
    if total % tp_size:
        raise ValueError(f"{what} heads: {total} heads do not split across tensor_parallel_size={tp_size}")
    return total // tp_size


def local_kv_heads(total: int, tp_size: int, what: str = "KV") -> int:
    """KV heads of one rank as vLLM's QKVParallelLinear lays them out: split when tp_size <= total
    (total must divide), else one head per rank, each replicated on tp_size / total ranks."""
    if tp_size <= total:
        return local_heads(total, tp_size, what)
    if tp_size % total:
        raise ValueError(f"{what} heads: tensor_parallel_size={tp_size} is not a multiple of the {total} heads")
    return 1


def tensor_parallel_refusal(tp_size: int, *, sa_heads: int, sa_kv_heads: int, ca_heads: int,
                            ca_kv_heads: int, target_kv_heads: int) -> str | None:
    """Why a drafter with these head counts cannot run at tensor parallel size `tp_size` (None: it can).
    CA's keys/values come from a column-parallel projection of the Ekv2E rows, which splits whole
    heads only: CA's KV heads must divide (no replication)."""
    try:
        local_heads(sa_heads, tp_size, "the drafter's SA")
        local_kv_heads(sa_kv_heads, tp_size, "the drafter's SA KV")
        local_heads(ca_heads, tp_size, "the drafter's CA")
        local_heads(ca_kv_heads, tp_size, "the drafter's CA KV")
        local_kv_heads(target_kv_heads, tp_size, "the target's KV")
    except ValueError as error:
        return str(error)
    return None


def cpu_thread_binding(tp: int, cores: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` ranks on `cores`: all of them for one rank, else rank r on
    core r mod n (two ranks share a core when there are more ranks than cores)."""
    if tp == 1:
        return f"{cores[0]}-{cores[-1]}"
    return "|".join(str(cores[r % len(cores)]) for r in range(tp))


def tp_size() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size()
