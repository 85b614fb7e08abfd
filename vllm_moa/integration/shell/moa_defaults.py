"""What speculative method "moa" does with the options a user leaves out: the best configuration
measured inside vLLM's engine, so that `{"method": "moa"}` alone is the configuration to use.

    model                    the shipped MoA drafter trained for this target (its signature and
                             weight fingerprint match), else a one-line refusal saying how to train one
    num_speculative_tokens   4 (MoA + lookup chains: K = 4 measured best at concurrency 1,
                             docs/results.md)
    moa_retrieval            {} (lookup drafts merged into the model's; `false` turns it off):
                             never slower than MoA alone in vLLM's CPU engine, at concurrency 1 and 16
    moa_adaptive             true without a schedule of the user's: K per batch size, 0 included,
                             chosen from measured tokens per second (adaptive_k.py); a tree
                             (moa_tree) chooses among the whole tree, the chains of its best
                             path up to tree_chain_k tokens and K = 0; `false` drafts K (the
                             whole tree) at every step

A drafter checkpoint that carries speculators keys (speculators_format.py) fills these first: its
proposal method's speculative_tokens, moa_tree, moa_retrieval and moa_adaptive, for the fields the
user left out; this table fills what both leave out.

No vLLM import here: the functions take plain values and the SpeculativeConfig being built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_moa.config import DrafterConfigError, DrafterTargetMismatch, read_drafter_config
from vllm_moa.integration.shell.draft_config import ADAPTIVE_FIELD, RETRIEVAL_FIELD, SCHEDULE_FIELD
from vllm_moa.shipped import MOA_DRAFTERS, SHIPPED, SHIPPED_SMOLLM2
from vllm_moa.speculators_format import RECOMMENDED_SPECULATIVE_TOKENS, read_speculators_section

DEFAULT_NUM_SPECULATIVE_TOKENS = RECOMMENDED_SPECULATIVE_TOKENS
# the defaults turned off: MoA's drafts alone, K at every step (benchmarks' and tests' "moa K=k")
MOA_ALONE = {RETRIEVAL_FIELD: False, ADAPTIVE_FIELD: False}
TRAIN_HINT = ("train one for it (`vllm-moa train --target <target dir> --prompts <prompts.jsonl>`) and pass "
              "its directory as \"model\"")


def shipped_moa_drafters() -> list[Path]:
    """The MoA drafters inside the package, TLI = 0 first (trees need TLI = 0)."""
    return [root / name for name in MOA_DRAFTERS for root in (SHIPPED_SMOLLM2, SHIPPED)
            if (root / name / "model.safetensors").is_file()]


def shipped_drafter_for(actual: Any) -> Path:
    """The first shipped MoA drafter whose target signature is `actual`'s (a TargetSignature),
    weight fingerprint included; raises DrafterConfigError (one line, how to train one) without."""
    for directory in shipped_moa_drafters():
        config = read_drafter_config(directory)
        wanted = config.target_signature
        if not (actual.fingerprint and wanted.fingerprint == actual.fingerprint):
            continue  # shapes alone do not say the weights are the ones it was trained on
        try:
            wanted.check_compatible(actual)
        except DrafterTargetMismatch:
            continue
        return directory
    raise DrafterConfigError(
        f"speculative method 'moa' without \"model\": no MoA drafter shipped with vllm-moa was trained for this "
        f"target ({actual.name or '?'}: {actual.architecture}, {actual.num_layers} layers, vocabulary "
        f"{actual.vocab_size}); {TRAIN_HINT}")


def resolve_adaptive(value: Any, *, user_schedule: bool) -> bool:
    """moa_adaptive as given (None: left out) -> whether K follows measured speed (chains and
    trees alike); refuses what cannot be honoured, naming it."""
    if value is not None and not isinstance(value, bool):
        raise DrafterConfigError(f"{ADAPTIVE_FIELD} must be true or false, got {value!r}")
    if value is True and user_schedule:
        raise DrafterConfigError(f"{ADAPTIVE_FIELD} measures K per batch size; {SCHEDULE_FIELD} writes it: "
                                 "drop one of them")
    if value is None:
        return not user_schedule
    return value


def apply_defaults(speculative_config: Any, actual: Any) -> None:
    """Fill the options a "moa" SpeculativeConfig leaves out (this module's table), in place,
    before vLLM's own __post_init__ runs. `actual`: the target's TargetSignature."""
    spec = speculative_config
    if not spec.model:
        spec.model = str(shipped_drafter_for(actual))
    apply_checkpoint_proposal(spec)
    if spec.num_speculative_tokens is None:
        spec.num_speculative_tokens = DEFAULT_NUM_SPECULATIVE_TOKENS
    if getattr(spec, RETRIEVAL_FIELD, None) is None:
        setattr(spec, RETRIEVAL_FIELD, {})
    adaptive = resolve_adaptive(getattr(spec, ADAPTIVE_FIELD, None),
                                user_schedule=getattr(spec, SCHEDULE_FIELD, None) is not None)
    setattr(spec, ADAPTIVE_FIELD, adaptive)
    if adaptive:
        setattr(spec, SCHEDULE_FIELD, adaptive_schedule(spec.num_speculative_tokens))


# K by measured speed (adaptive_k.py) with nothing priced near a batch size: up to this many
# requests it prices K = max_k first, more start at K = 0
COLD_BATCH = 4


def tree_chain_k(depth: int, budget: int) -> int | None:
    """The longest chain a tree engine with K by measured speed falls back to: the chain default
    (DEFAULT_NUM_SPECULATIVE_TOKENS), no deeper than the tree and below its node budget; None
    where no chain fits (a budget of 1)."""
    k = min(depth, DEFAULT_NUM_SPECULATIVE_TOKENS, budget - 1)
    return k if k >= 1 else None


def adaptive_schedule(max_k: int) -> list[tuple[int, int, int]]:
    """vLLM's schedule field for an engine whose K follows measured speed: vLLM's own mark of a K
    that changes per step (it keeps full CUDA graphs off, and turns the schedule off under data
    parallelism). The scheduler's table is then measured (adaptive_k.SchedulerUpdatePatch installs
    it after the first step); for that first step, often a fresh engine's prefill of every request,
    this one says what the measured table does with nothing measured: max_k up to
    COLD_BATCH requests, 0 above (a drafter that skips a step catches up later)."""
    return [(1, COLD_BATCH, max_k), (COLD_BATCH + 1, COLD_BATCH + 1, 0)]


def apply_checkpoint_proposal(speculative_config: Any) -> None:
    """The drafter checkpoint's proposal method (its speculators keys), for the fields left out."""
    spec = speculative_config
    if not (Path(spec.model) / "config.json").is_file():
        return  # check_moa_drafter names what is wrong with the path
    section = read_speculators_section(spec.model)
    if section is None:
        return
    if spec.num_speculative_tokens is None:
        spec.num_speculative_tokens = section.proposal.speculative_tokens
    for field, value in section.moa_fields().items():
        if getattr(spec, field, None) is None:
            setattr(spec, field, value)


def requested_adaptive(speculative_config: Any) -> bool:
    """Whether a built "moa" SpeculativeConfig chooses K by measured speed (apply_defaults ran)."""
    return getattr(speculative_config, ADAPTIVE_FIELD, None) is True \
        and getattr(speculative_config, SCHEDULE_FIELD, None) is not None
