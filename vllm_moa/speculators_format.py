"""A drafter checkpoint in the speculators format (vllm-project/speculators), so that vLLM serves
it by its directory alone: `vllm serve <drafter dir>` / `LLM(model=<drafter dir>)`.

vLLM reads these keys from a model's config.json before anything else
(`maybe_override_with_speculators`): where `speculators_config` is present it serves
`speculators_config.verifier.name_or_path` as the model, with speculative method
`speculators_model_type` and `proposal_methods[0].speculative_tokens` tokens, the directory
itself as the drafter. They sit beside the drafter's own config, which keeps every key it had
(config.py accepts them and keeps them out of the drafter's options):

    speculators_model_type     the algorithm: "moa" (DrafterConfigBase.SPECULATORS_ALGORITHM)
    speculators_config         algorithm, default_proposal_method, proposal_methods (the first is
                               what vLLM runs: speculative_tokens, and for "moa" the options left
                               out of a user's --speculative-config: moa_tree, moa_retrieval,
                               moa_adaptive), verifier {name_or_path, architectures}
    transformer_layer_config   the drafter's decoder layer as a Llama layer (vLLM requires the key;
                               the drafter's own config.json is what builds the model)

The verifier's name_or_path is a local directory, a Hugging Face id, or the folder name of a target
this package fetches (`vllm-moa fetch smollm2` -> "smollm2-135m-instruct"), which the plugin finds
in the package's cache (integration/shell/speculators_checkpoints.py).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vllm_moa.config import (
    CONFIG_NAME,
    SPECULATORS_KEYS,
    DrafterConfigBase,
    DrafterConfigError,
    read_config_json,
    read_drafter_config,
)

# MoA + lookup chains: K = 4 measured best in vLLM's CPU engine at concurrency 1 (docs/results.md);
# what `{"method": "moa"}` drafts without num_speculative_tokens, and what checkpoints record
RECOMMENDED_SPECULATIVE_TOKENS = 4
# proposal-method keys that carry a "moa" speculative-config field of the same name
MOA_PROPOSAL_FIELDS = ("moa_tree", "moa_retrieval", "moa_adaptive")


class ProposalMethod(BaseModel):
    """One entry of speculators_config.proposal_methods (vLLM runs the first)."""

    model_config = ConfigDict(extra="forbid")
    proposal_type: Literal["greedy", "tree"] = "greedy"
    speculative_tokens: int = Field(ge=1, le=64)
    moa_tree: dict[str, Any] | None = None
    moa_retrieval: dict[str, Any] | Literal[False] | None = None
    moa_adaptive: bool | None = None


class Verifier(BaseModel):
    """The target the drafter drafts for: what vLLM serves as the model."""

    model_config = ConfigDict(extra="allow")
    name_or_path: str = Field(min_length=1)
    architectures: list[str] = Field(default_factory=list)


class SpeculatorsSection(BaseModel):
    """speculators_config, as this package writes and reads it."""

    model_config = ConfigDict(extra="allow")
    algorithm: str
    default_proposal_method: str = "greedy"
    proposal_methods: list[ProposalMethod] = Field(min_length=1)
    verifier: Verifier

    @property
    def proposal(self) -> ProposalMethod:
        return self.proposal_methods[0]

    def moa_fields(self) -> dict[str, Any]:
        """The moa_* speculative-config fields the checkpoint sets (those it leaves out absent)."""
        return {key: getattr(self.proposal, key) for key in MOA_PROPOSAL_FIELDS if getattr(self.proposal, key) is not None}


def read_speculators_section(directory: str | Path) -> SpeculatorsSection | None:
    """The checkpoint's speculators section, None where it has none; DrafterConfigError naming
    the key where it is malformed."""
    path, data = read_config_json(directory)
    return section_from_dict(data, str(path))


def section_from_dict(data: Any, source: str) -> SpeculatorsSection | None:
    """section of an already parsed config.json (see read_speculators_section)."""
    if not isinstance(data, dict) or "speculators_config" not in data:
        return None
    try:
        section = SpeculatorsSection.model_validate(data["speculators_config"])
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise DrafterConfigError(f"{source}: speculators_config.{where}: {first['msg']}") from None
    if data.get("speculators_model_type") != section.algorithm:
        raise DrafterConfigError(f"{source}: speculators_model_type is {data.get('speculators_model_type')!r}, "
                                 f"speculators_config.algorithm {section.algorithm!r}: they must be the same")
    if not isinstance(data.get("transformer_layer_config"), dict):
        raise DrafterConfigError(f"{source}: transformer_layer_config must be an object (vLLM requires it)")
    return section


def speculators_keys(config: DrafterConfigBase, verifier: str, verifier_architectures: list[str], *,
                     speculative_tokens: int = RECOMMENDED_SPECULATIVE_TOKENS,
                     moa_tree: dict[str, Any] | None = None, moa_retrieval: dict[str, Any] | bool | None = None,
                     moa_adaptive: bool | None = None) -> dict[str, Any]:
    """The speculators keys of a servable drafter's config.json (module docstring)."""
    algorithm = type(config).SPECULATORS_ALGORITHM
    if algorithm is None:
        raise DrafterConfigError(f"a {config.model_type!r} drafter is not served by vLLM; only MoA drafters are "
                                 "(speculative method 'moa')")
    if moa_retrieval is True:
        moa_retrieval = {}
    proposal = ProposalMethod(proposal_type="tree" if moa_tree else "greedy", speculative_tokens=speculative_tokens,
                              moa_tree=moa_tree, moa_retrieval=moa_retrieval, moa_adaptive=moa_adaptive)
    section = SpeculatorsSection(algorithm=algorithm, default_proposal_method=proposal.proposal_type,
                                 proposal_methods=[proposal],
                                 verifier=Verifier(name_or_path=verifier, architectures=verifier_architectures))
    signature = config.target_signature
    layer = {  # SA's block, the drafter's decoder layer, in Llama's terms
        "model_type": "llama", "hidden_size": signature.hidden_size, "vocab_size": signature.vocab_size,
        "num_attention_heads": getattr(config, "sa_num_heads", signature.num_attention_heads),
        "num_key_value_heads": getattr(config, "sa_num_kv_heads", signature.num_kv_heads),
        "head_dim": getattr(config, "sa_head_dim", signature.head_dim),
        "intermediate_size": getattr(config, "sa_intermediate_size", None),
        "rms_norm_eps": getattr(config, "rms_norm_eps", None), "rope_theta": getattr(config, "rope_theta", None),
        "num_hidden_layers": 1,
    }
    return {
        "speculators_model_type": algorithm,
        "speculators_config": section.model_dump(mode="json", exclude_none=True),
        "transformer_layer_config": {k: v for k, v in layer.items() if v is not None},
    }


def write_speculators_config(directory: str | Path, verifier: str, verifier_architectures: list[str] | None = None,
                             **proposal: Any) -> dict[str, Any]:
    """Add (or replace) the speculators keys in a drafter directory's config.json, atomically;
    returns them. `verifier`: the target's directory, Hugging Face id or fetched-target folder name;
    `verifier_architectures` default to the target signature's architecture; `proposal`:
    speculative_tokens, moa_tree, moa_retrieval, moa_adaptive (speculators_keys)."""
    directory = Path(directory)
    config = read_drafter_config(directory)  # validates it, and says which kind it is
    architectures = verifier_architectures or [config.target_signature.architecture]
    keys = speculators_keys(config, verifier, architectures, **proposal)
    path = directory / CONFIG_NAME
    data = {k: v for k, v in json.loads(path.read_text(encoding="utf-8")).items() if k not in SPECULATORS_KEYS}
    data.update(keys)
    handle, tmp = tempfile.mkstemp(prefix=f".{CONFIG_NAME}.", dir=directory)
    with os.fdopen(handle, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return keys
