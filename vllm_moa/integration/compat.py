"""Everything in the plugin that depends on the vLLM version, in one place.

Supported: the vLLM 0.26 series (0.26.0 is the release whose torch==2.11.0 pin matches our GPU
machine). The patches in patches.py touch private vLLM internals whose shape is recorded below;
tests/integration/vllm/test_vllm_patches.py fails when the installed vLLM moves or changes any of them.

This module imports nothing from vLLM at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

from torch import Tensor

METHOD = "moa"  # SpeculativeConfig.method
ARCHITECTURE = "MoADraftModel"  # the drafter's vLLM architecture name (ModelRegistry)
MODEL_CLASS = "vllm_moa.integration.model:MoADraftModel"

# The vLLM series whose internals patches.py was written against, and what was run on each.
SUPPORTED_SERIES = ">=0.26.0,<0.27"
TESTED_PYTHON_LEVEL = ("0.26.0",)  # config, patches, CPU numerics of the vLLM-native model
TESTED_END_TO_END = ()  # generation on a GPU through vLLM: not yet (no GPU in CI)

ALLOW_UNTESTED_ENV = "VLLM_MOA_ALLOW_UNTESTED_VLLM"


def installed_vllm_version() -> str | None:
    """The installed vLLM version from package metadata (vLLM is not imported)."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


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
    # local build tags (0.26.0+cu130) are the same release
    if Version(parsed.base_version) in SpecifierSet(SUPPORTED_SERIES):
        return None
    return (
        f"vllm-moa's 'moa' speculative method supports vLLM {SUPPORTED_SERIES} "
        f"(tested at Python level: {', '.join(TESTED_PYTHON_LEVEL)}); installed is {version}. "
        f"The plugin did not patch vLLM. Set {ALLOW_UNTESTED_ENV}=1 to try anyway."
    )


# -- the private vLLM symbols the plugin touches, as found in 0.26.0 ---------------------------
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
}

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


def kv_layout_for_backend(backend_name: str) -> KVLayout:
    """The layout reader for an attention backend (`AttentionBackend.get_name()`)."""
    if backend_name in PACKED_KV_BACKENDS:
        return packed_kv_layout
    raise ValueError(
        f"MoA reads the target's KV cache directly and knows the layouts of {', '.join(PACKED_KV_BACKENDS)} "
        f"in vLLM 0.26; the target runs on attention backend {backend_name!r}. Pick one of those "
        "(--attention-backend / VLLM_ATTENTION_BACKEND)."
    )
