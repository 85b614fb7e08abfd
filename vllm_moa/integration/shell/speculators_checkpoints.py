"""MoA drafters served by their directory alone, as vLLM serves speculators checkpoints:
`vllm serve <MoA drafter dir>` and `LLM(model=<MoA drafter dir>)` serve the drafter's verifier
with speculative method "moa" (the checkpoint's keys: vllm_moa/speculators_format.py).

vLLM reads a model's `speculators_config` in EngineArgs.create_engine_config, through
`maybe_override_with_speculators`, which the plugin wraps (one declared patch):

    SpeculatorsOverridePatch  arg_utils.maybe_override_with_speculators
        for a MoA drafter's directory: the verifier is found where this package keeps it (a path
        relative to the drafter's directory, or a target `vllm-moa fetch` converts, found in the
        package's cache: no model hub is asked), else one line names the paths tried and the fix;
        a MoA drafter written before its checkpoints carried the speculators keys gets one line
        naming the command that adds them. The speculative config is built as vLLM 0.32 builds it
        (the checkpoint's method and K, a user's --speculative-config over them) on every
        supported vLLM: 0.26 drops the user's fields, 0.33 refuses local verifiers. Any other
        model goes to vLLM's function unchanged

and vLLM's speculators registry learns the algorithm "moa" (`register_speculator`), so that a
MoA checkpoint read as a SpeculatorsConfig (a config.json without model_type) builds the drafter.
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Any

from vllm_moa.config import CONFIG_NAME, SPECULATORS_KEYS, DrafterConfigError
from vllm_moa.integration.shell import compat
from vllm_moa.integration.shell.patching import VllmPatch
from vllm_moa.kinds.moa import MoAConfig
from vllm_moa.speculators_format import SpeculatorsSection, section_from_dict
from vllm_moa.targets import fetched_target

ADD_KEYS_COMMAND = "vllm-moa speculators-config {drafter} --verifier <target directory>"


class SpeculatorsCheckpointError(ValueError):
    """A MoA drafter given as the model that cannot be served: one line, with the fix."""


def moa_checkpoint(model: Any) -> SpeculatorsSection | None:
    """The speculators section of `model` when it is a local MoA drafter directory; None for any
    other model (vLLM goes on as without the plugin). Raises SpeculatorsCheckpointError for a MoA
    drafter that has no section, or a malformed one."""
    if not isinstance(model, (str, Path)):
        return None
    path = Path(model) / CONFIG_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # vLLM says what is wrong with it
    if not isinstance(data, dict) or data.get("model_type") != MoAConfig.model_type:
        return None
    try:
        section = section_from_dict(data, str(path))
    except DrafterConfigError as err:
        raise SpeculatorsCheckpointError(str(err)) from None
    if section is None:
        raise SpeculatorsCheckpointError(
            f"{model} is a MoA drafter without a verifier in its config.json (written before drafters carried "
            f"speculators keys): add them with `{ADD_KEYS_COMMAND.format(drafter=model)}`, or serve its target "
            f"with it: `vllm serve <target directory> --speculative-config "
            f"'{{\"method\": \"{compat.METHOD}\", \"model\": \"{model}\"}}'`")
    if section.algorithm != compat.METHOD:
        raise SpeculatorsCheckpointError(f"{path}: speculators_model_type is {section.algorithm!r}; a MoA drafter's "
                                         f"is {compat.METHOD!r}")
    return section


def resolve_verifier(name_or_path: str, drafter: Path) -> str:
    """Where the verifier a MoA checkpoint names is: an existing path (absolute, or relative to the
    drafter's directory, then to the working directory), or a target this package fetches (its
    cached folder). A Hugging Face id ("org/name" that is no local path) is returned as it is, for
    vLLM to download. Raises SpeculatorsCheckpointError naming what was tried."""
    named = Path(name_or_path).expanduser()
    candidates = [named] if named.is_absolute() else [drafter / named, Path.cwd() / named]
    for candidate in candidates:
        if candidate.is_dir():
            return str(candidate.resolve())
    fetched = fetched_target(name_or_path)
    if fetched is not None:
        folder, command = fetched
        if folder is not None:
            return str(folder)
        raise SpeculatorsCheckpointError(
            f"{drafter}: its verifier {name_or_path!r} is not fetched yet: run `{command}` (it converts into the "
            "package's cache, $VLLM_MOA_CACHE)")
    if _hub_id(name_or_path):
        return name_or_path
    tried = " or ".join(str(c) for c in candidates)
    raise SpeculatorsCheckpointError(
        f"{drafter}: its verifier {name_or_path!r} (speculators_config.verifier.name_or_path) was not found: no "
        f"directory {tried}; point it at the target's directory (`{ADD_KEYS_COMMAND.format(drafter=drafter)}`)")


def _hub_id(name: str) -> bool:
    """"org/name" as the Hugging Face hub writes it (not a path: no leading ./, ../, / or ~)."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~")) and "\\" not in name


def update_moa(config_dict: dict, pre_trained_config: dict) -> None:
    """vLLM's speculators updater for "moa": the drafter's own keys and architecture."""
    pre_trained_config.update({k: v for k, v in config_dict.items() if k not in SPECULATORS_KEYS})
    pre_trained_config["architectures"] = [compat.ARCHITECTURE]


def register_moa_speculator() -> bool:
    """Add "moa" to vLLM's speculators registry (idempotent); whether this vLLM has the registry."""
    try:
        from vllm.transformers_utils.configs.speculators import algos
    except ImportError:
        return False
    algos.SUPPORTED_SPECULATORS_TYPES.setdefault(compat.METHOD, update_moa)
    return True


class SpeculatorsOverridePatch(VllmPatch):
    """maybe_override_with_speculators(model, tokenizer, ...) -> (model, tokenizer, speculative
    config): vLLM's own, then for a MoA checkpoint the verifier as resolve_verifier finds it."""

    symbol = "speculators_override"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        signature = inspect.signature(original)

        @functools.wraps(original)
        def maybe_override_with_speculators(*args, **kwargs):
            given = signature.bind(*args, **kwargs).arguments
            model, tokenizer = given["model"], given.get("tokenizer")
            section = moa_checkpoint(model)
            if section is None:
                return original(*args, **kwargs)
            verifier = resolve_verifier(section.verifier.name_or_path, Path(str(model)))
            return verifier, tokenizer or verifier, moa_speculative_config(section, str(model),
                                                                           given.get("vllm_speculative_config"))

        setattr(owner, attr, maybe_override_with_speculators)


def moa_speculative_config(section: SpeculatorsSection, drafter: str, users: Any) -> dict[str, Any]:
    """What vLLM 0.32 builds from a speculators checkpoint, for every supported vLLM: the method and
    K of the checkpoint, the user's --speculative-config over them (0.26 drops it), the method and
    the drafter's directory locked. (0.33 refuses a verifier that is a local path; a MoA
    checkpoint's verifier is resolved above, next to the directory the user named.)"""
    config: dict[str, Any] = {"method": compat.METHOD, "num_speculative_tokens": section.proposal.speculative_tokens}
    if isinstance(users, dict):
        config.update(users)
    config.update(method=compat.METHOD, model=drafter)
    return config
