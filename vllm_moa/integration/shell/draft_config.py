"""The MoA drafter's config as vLLM sees it, and the checks run when vLLM builds its
SpeculativeConfig (in the front-end process, before any engine or GPU memory exists).

No vLLM import here: the checks take plain values, so they are testable anywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_moa import envs
from vllm_moa.config import DrafterConfigError, read_drafter_config
from vllm_moa.integration.shell import compat
from vllm_moa.integration.shell.signature import signature_from_hf_config
from vllm_moa.integration.shell.tp_layout import tensor_parallel_refusal, tp_options
from vllm_moa.kinds.moa import MoAConfig
from vllm_moa.packed_linear import check_drafter_weights

# The drafter keeps no position table (RoPE), so its own length limit never binds; vLLM takes
# min(this, the target's max_model_len).
UNBOUNDED_POSITIONS = 1 << 24


class UnsupportedMoASetup(ValueError):
    """A valid drafter asked for in a setup the plugin does not run (yet)."""


class MoAVllmConfig(MoAConfig):
    """MoAConfig (same config.json) plus the standard attributes vLLM derives sizes from.

    hidden_size / vocab_size are the target's; the head counts are SA's (vLLM only reads them for
    bookkeeping: the KV-cache specs come from the model's attention layers themselves).
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("architectures", [compat.ARCHITECTURE])
        super().__init__(**kwargs)
        if self.target is not None:
            sig = self.target_signature
            self.hidden_size = sig.hidden_size
            self.vocab_size = sig.vocab_size
        self.num_hidden_layers = 2  # SA and CA: the drafter's two KV-cached attentions
        self.num_attention_heads = self.sa_num_heads
        self.num_key_value_heads = self.sa_num_kv_heads
        self.head_dim = self.sa_head_dim
        self.max_position_embeddings = UNBOUNDED_POSITIONS


def register_hf_config() -> None:
    """Make transformers' AutoConfig (which vLLM calls) build MoAVllmConfig for model_type
    "moa_drafter". Idempotent."""
    from transformers import AutoConfig

    AutoConfig.register(MoAVllmConfig.model_type, MoAVllmConfig, exist_ok=True)


def check_moa_drafter(
    drafter: str | None,
    target_hf_config: Any,
    target_path: str | None,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    draft_tensor_parallel_size: int | None = None,
    strict_fingerprint: bool = True,
    actual: Any = None,
) -> MoAConfig:
    """Validate a speculative_config {"method": "moa", "model": drafter, ...} against the target.

    Raises DrafterConfigError (malformed or non-MoA drafter, naming the key), DrafterTargetMismatch
    (trained for another target, naming the field) or UnsupportedMoASetup. Returns the config.
    """
    if not drafter:
        raise DrafterConfigError(
            "speculative method 'moa' needs 'model': the MoA drafter directory (config.json + model.safetensors)"
        )
    path = Path(drafter)
    if not path.is_dir():
        raise DrafterConfigError(
            f"MoA drafter {drafter!r} is not a local directory; download it first "
            "(e.g. `huggingface-cli download <repo> --local-dir <dir>`) and pass the directory"
        )
    lowered = str(drafter).lower()
    for needle in compat.METHOD_AUTODETECT_SUBSTRINGS:
        if needle in lowered:
            raise UnsupportedMoASetup(
                f"MoA drafter path {drafter!r} contains {needle!r}, which vLLM's speculative config "
                "takes as the name of another method (EAGLE/DFlash/DSpark auto-detection); rename the directory"
            )
    config = read_drafter_config(path)
    if not isinstance(config, MoAConfig):
        raise DrafterConfigError(
            f"{path}: model_type is {config.model_type!r}, but speculative method 'moa' needs a MoA drafter "
            f"(model_type {MoAConfig.model_type!r})"
        )
    if actual is None:  # the target's TargetSignature, unless the caller read it already
        actual = signature_from_hf_config(target_hf_config, target_path)
    config.target_signature.check_compatible(actual, strict_fingerprint=strict_fingerprint)

    check_parallel_setup(config, target_hf_config, tensor_parallel_size, pipeline_parallel_size,
                         draft_tensor_parallel_size)
    try:  # read again by the worker (integration/moa/draft_model.py): refused here, before any engine starts
        check_drafter_weights(envs.VLLM_MOA_DRAFTER_WEIGHTS, "VLLM_MOA_DRAFTER_WEIGHTS")
        tp_options()
    except ValueError as err:
        raise UnsupportedMoASetup(str(err)) from None
    window = getattr(target_hf_config, "sliding_window", None)
    if getattr(target_hf_config, "use_sliding_window", True) and window and \
            window < getattr(target_hf_config, "max_position_embeddings", 0):
        raise UnsupportedMoASetup(
            f"the target uses sliding-window attention (sliding_window={window}); MoA needs every "
            "verified token's KV in every layer"
        )
    return config


def check_parallel_setup(config: MoAConfig, target_hf_config: Any, tensor_parallel_size: int,
                         pipeline_parallel_size: int, draft_tensor_parallel_size: int | None) -> None:
    """Tensor parallelism: the drafter is sharded like the target (docs/sharded-targets.md), so
    its heads must split the same way. Pipeline parallelism: refused (the reason below)."""
    if pipeline_parallel_size != 1:
        raise UnsupportedMoASetup(
            f"pipeline_parallel_size={pipeline_parallel_size}: vLLM drafts on the last pipeline stage, which "
            "holds only its own layers' KV cache, and MoA's layer self-attention reads every layer's; "
            "use tensor parallelism (docs/sharded-targets.md)")
    if draft_tensor_parallel_size not in (None, tensor_parallel_size):
        raise UnsupportedMoASetup(
            f"draft_tensor_parallel_size={draft_tensor_parallel_size}: the MoA drafter is sharded like the "
            f"target (its attention heads split by tensor_parallel_size={tensor_parallel_size}); leave "
            "draft_tensor_parallel_size unset or equal to tensor_parallel_size")
    if tensor_parallel_size == 1:
        return
    target_kv = getattr(target_hf_config, "num_key_value_heads", None) or target_hf_config.num_attention_heads
    reason = tensor_parallel_refusal(
        tensor_parallel_size, sa_heads=config.sa_num_heads, sa_kv_heads=config.sa_num_kv_heads,
        ca_heads=config.ca_num_heads, ca_kv_heads=config.ca_num_kv_heads, target_kv_heads=target_kv)
    if reason is not None:
        raise UnsupportedMoASetup(f"tensor_parallel_size={tensor_parallel_size}: {reason}")


def check_kv_cache_dtype(cache_dtype: str, model_dtype: str) -> None:
    """The target's KV cache must hold model-dtype values: LSA reads it as such (no fp8 scales)."""
    if cache_dtype not in ("auto", model_dtype):
        raise UnsupportedMoASetup(
            f"kv_cache_dtype={cache_dtype!r}: MoA reads the target's KV cache as {model_dtype} values; "
            "quantised or converted KV caches are not supported (leave kv_cache_dtype at 'auto')"
        )


V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def check_model_runner(v2_env_value: str | None) -> None:
    """MoA drafts through the V1 model runner (patches.V1RunnerPatch keeps it there); a user who
    forces Model Runner V2 would get a speculator that never taps the target."""
    if v2_env_value is not None and v2_env_value.strip().lower() in ("1", "true", "yes", "on"):
        raise UnsupportedMoASetup(
            f"{V2_RUNNER_ENV}={v2_env_value}: speculative method 'moa' runs on vLLM's V1 model runner "
            f"(Model Runner V2 has no MoA speculator yet); unset {V2_RUNNER_ENV}"
        )


# -- draft trees ----------------------------------------------------------------------------------
def check_object_keys(field: str, value: Any, allowed: tuple[str, ...], example: str, hint: str) -> None:
    """A speculative_config object option: a dict whose keys are among `allowed`."""
    if not isinstance(value, dict):
        raise UnsupportedMoASetup(f"{field} must be an object like {example}, got {value!r}")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise UnsupportedMoASetup(f"unknown key(s) {unknown} in {field}; {hint} {list(allowed)} "
                                  "(the node budget is num_speculative_tokens)")


TREE_FIELD = "moa_tree"  # speculative_config key (patches.TreeFieldPatch declares it on SpeculativeConfig)
TREE_KEYS = ("depth", "top_k")  # required
TREE_CHAIN_IF_FASTER = "chain_if_faster"  # optional, true by default (integration/moa/tree_or_chain.py)
MAX_TREE_NODES = 64  # kernels.tree: a node's ancestors are one int64 bitmask


def tree_spec(moa_tree: Any, budget: int, tli: int, vllm_version: str | None = None) -> Any:
    """speculative_config {"method": "moa", "num_speculative_tokens": B, "moa_tree": {"depth": D,
    "top_k": K}} -> the DraftSpec of an EAGLE-2 tree of B nodes (B is vLLM's slot accounting: the
    scheduler reserves and verifies B draft tokens per request, as for a chain of B); None without
    moa_tree (chains, the default). Raises UnsupportedMoASetup naming what does not fit."""
    from vllm_moa.decoding.tree import DraftSpec

    if moa_tree is None:
        return None
    check_object_keys(TREE_FIELD, moa_tree, (*TREE_KEYS, TREE_CHAIN_IF_FASTER), '{"depth": 5, "top_k": 4}', "it takes")
    if not isinstance(moa_tree.get(TREE_CHAIN_IF_FASTER, True), bool):
        raise UnsupportedMoASetup(f"{TREE_FIELD}.{TREE_CHAIN_IF_FASTER} must be true or false, "
                                  f"got {moa_tree[TREE_CHAIN_IF_FASTER]!r}")
    values = {}
    for key in TREE_KEYS:
        value = moa_tree.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UnsupportedMoASetup(f"{TREE_FIELD}.{key} must be an integer >= 1, got {value!r}")
        values[key] = value
    if budget > MAX_TREE_NODES:
        raise UnsupportedMoASetup(f"a draft tree of num_speculative_tokens={budget} nodes: at most "
                                  f"{MAX_TREE_NODES} nodes are verified per request")
    if tli != 0:
        raise UnsupportedMoASetup(f"draft trees ({TREE_FIELD}) run with MoA TLI=0 drafters; this drafter has "
                                  f"TLI={tli} (use it as a chain: drop {TREE_FIELD})")
    if vllm_version is not None and not compat.in_series(vllm_version, compat.TREE_SERIES):
        raise UnsupportedMoASetup(f"draft trees ({TREE_FIELD}) are verified inside vLLM {compat.TREE_VERSIONS}; "
                                  f"this is vLLM {vllm_version} (chains run there: drop {TREE_FIELD})")
    try:
        return DraftSpec.tree(depth=values["depth"], top_k=values["top_k"], budget=budget)
    except ValueError as err:
        raise UnsupportedMoASetup(f"{TREE_FIELD} {moa_tree} with num_speculative_tokens={budget}: {err}") from None


def requested_tree(speculative_config: Any) -> Any:
    """The DraftSpec of the tree a MoA speculative_config asks for (tree_spec), None for chains."""
    spec = speculative_config
    return tree_spec(getattr(spec, TREE_FIELD, None), spec.num_speculative_tokens,
                     spec.draft_model_config.hf_config.tli, compat.installed_vllm_version())


def requested_chain_if_faster(speculative_config: Any) -> bool:
    """Whether a MoA speculative_config's tree drafts the chain of its budget in the steps where
    that measures faster (moa_tree.chain_if_faster, true unless set false; validated by tree_spec)."""
    moa_tree = getattr(speculative_config, TREE_FIELD, None)
    return moa_tree is not None and moa_tree.get(TREE_CHAIN_IF_FASTER, True) is True


# -- retrieval (lookup drafts beside the model's) ------------------------------------------------
RETRIEVAL_FIELD = "moa_retrieval"  # speculative_config key (patches.RetrievalFieldPatch declares it)
ADAPTIVE_FIELD = "moa_adaptive"  # speculative_config key (patches.AdaptiveFieldPatch declares it)
SCHEDULE_FIELD = "num_speculative_tokens_per_batch_size"  # vLLM's own K by batch size
RETRIEVAL_IN_VLLM = ("max_ngram", "min_ngram", "branches", "alone_at")  # extra_nodes: the budget is fixed


def retrieval_options(moa_retrieval: Any) -> Any:
    """speculative_config {"method": "moa", ..., "moa_retrieval": {"max_ngram": 4, ...}} -> the
    decoding.retrieval.Retrieval options (validated there, declared once); None for false (off);
    {} takes every default (what moa_defaults puts where the key is left out). Raises UnsupportedMoASetup naming what does not fit."""
    from pydantic import ValidationError

    from vllm_moa.decoding.retrieval import Retrieval

    if moa_retrieval is None or moa_retrieval is False:  # left out (before moa_defaults ran) or turned off
        return None
    if moa_retrieval is True:
        moa_retrieval = {}
    check_object_keys(RETRIEVAL_FIELD, moa_retrieval, RETRIEVAL_IN_VLLM, '{"max_ngram": 4, "alone_at": 3}',
                      "inside vLLM it takes")
    try:
        return Retrieval(**moa_retrieval)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or RETRIEVAL_FIELD}: {e['msg']}" for e in err.errors())
        raise UnsupportedMoASetup(f"{RETRIEVAL_FIELD} {moa_retrieval}: {problems}") from None


def requested_retrieval(speculative_config: Any) -> Any:
    """The Retrieval options a MoA speculative_config asks for (retrieval_options), None without."""
    return retrieval_options(getattr(speculative_config, RETRIEVAL_FIELD, None))


def check_tree_setup(speculative_config: Any, kv_transfer_config: Any) -> None:
    """vLLM options that act on chain verification and that draft trees do not take (yet). A
    schedule of the user's is one; the mark moa_adaptive sets (moa_defaults.apply_defaults: K by
    measured speed: the tree, a chain of its best path or nothing) is not."""
    adaptive = getattr(speculative_config, ADAPTIVE_FIELD, None) is True
    chain_only = {
        SCHEDULE_FIELD: None if adaptive else getattr(speculative_config, SCHEDULE_FIELD, None),
        "rejection_sample_method": getattr(speculative_config, "rejection_sample_method", "standard") != "standard",
        "kv_transfer_config": kv_transfer_config,
    }
    for option, value in chain_only.items():
        if value:
            raise UnsupportedMoASetup(f"draft trees ({TREE_FIELD}) do not take {option} (it acts on vLLM's chain "
                                      f"verification or its KV layout per step); drop one of them")


def check_tree_graphs(cudagraph_mode: Any) -> None:
    """Draft trees mask the target's node rows in Python after the attention backend's kernel
    (shell/tree_patches.py): a full CUDA graph replays the kernel alone, so the tree mask would be
    skipped. `cudagraph_mode`: the engine's resolved CompilationConfig.cudagraph_mode (None or
    NONE: eager; PIECEWISE keeps attention outside the graphs)."""
    has_full = getattr(cudagraph_mode, "has_full_cudagraphs", None)
    if has_full is not None and has_full():
        raise UnsupportedMoASetup(
            f"draft trees ({TREE_FIELD}) verify with a tree mask applied outside CUDA graphs; this engine captures "
            f"full CUDA graphs (cudagraph_mode {cudagraph_mode.name}). Pass "
            "compilation_config={\"cudagraph_mode\": \"PIECEWISE\"} (or --enforce-eager), or drop "
            f"{TREE_FIELD} to draft chains")
