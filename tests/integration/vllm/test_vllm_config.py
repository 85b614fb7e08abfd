"""vLLM builds an engine config for speculative method "moa" from the same arguments as
`LLM(model, speculative_config={...})` and `vllm serve --speculative-config '{...}'`, carries the
MoA settings, still runs its own checks, and refuses bad drafters with messages that name the
problem -- all before any engine (or GPU memory) exists."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

from tiny_models import make_hf_target  # noqa: E402
from vllm_env import DEMO, engine_config  # noqa: E402

from vllm_moa.integration.shell import compat  # noqa: E402
from vllm_moa.integration.shell.draft_config import MoAVllmConfig  # noqa: E402

pytestmark = pytest.mark.vllm


def moa(drafter=DEMO / "moa-tli0", **extra):
    return {"method": "moa", "model": str(drafter), "num_speculative_tokens": 4, **extra}


def test_engine_config_carries_the_moa_settings(moa_config, demo_drafter):
    spec = moa_config.speculative_config
    assert spec.method == "moa" and spec.num_speculative_tokens == 4
    draft = spec.draft_model_config
    assert draft.model == demo_drafter and draft.architectures == [compat.ARCHITECTURE]
    hf = draft.hf_config
    assert isinstance(hf, MoAVllmConfig) and hf.tli == 0
    assert hf.target_signature.fingerprint == "73e191c1c8591c68"
    # vLLM's own draft-model set-up ran: draft TP resolved, length capped at the target's
    assert spec.draft_tensor_parallel_size == 1
    assert draft.max_model_len == moa_config.model_config.max_model_len
    assert draft.dtype == moa_config.model_config.dtype
    # the draft-model road: one extra slot per request, V1 runner, no async scheduling
    assert spec.uses_draft_model() and spec.max_num_new_slots_for_drafting == 1
    assert "speculative method 'moa'" in moa_config._get_v2_model_runner_unsupported_features()
    assert moa_config.scheduler_config.async_scheduling is False


def test_cli_arguments_of_vllm_serve(demo_target, demo_drafter):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    for flags in (["--speculative-config", json.dumps(moa(demo_drafter, num_speculative_tokens=5))],
                  ["--spec-method", "moa", "--spec-model", demo_drafter, "--spec-tokens", "5"]):
        args = parser.parse_args(["--model", demo_target, "--skip-tokenizer-init", *flags])
        spec = AsyncEngineArgs.from_cli_args(args).create_engine_config().speculative_config
        assert (spec.method, spec.num_speculative_tokens) == ("moa", 5)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "llama"
    make_hf_target("llama").save_pretrained(path)
    return str(path)


def refused(target, spec, *words, **kwargs):
    with pytest.raises(Exception) as err:  # pydantic wraps ValueErrors raised in __post_init__
        engine_config(target, spec, **kwargs)
    for word in words:
        assert word in str(err.value), str(err.value)
    return str(err.value)


def test_drafter_for_another_target(tiny_llama):
    refused(tiny_llama, moa(), "drafter was trained for a target with num_layers=8",
            "the given target has num_layers=4")


def test_unknown_key_in_drafter_config(tmp_path, demo_target):
    drafter = tmp_path / "moa"
    shutil.copytree(DEMO / "moa-tli0", drafter)
    config = json.loads((drafter / "config.json").read_text())
    config["ca_dropout"] = 0.0
    (drafter / "config.json").write_text(json.dumps(config))
    refused(demo_target, moa(drafter), "unknown key 'ca_dropout'")


def test_unknown_key_in_speculative_config(demo_target):
    refused(demo_target, moa(num_draft_heads=2), "num_draft_heads", "Unexpected keyword argument")


@pytest.mark.parametrize("spec,words", [
    (moa(DEMO / "eagle"), ["model_type is 'moa_eagle_drafter'", "needs a MoA drafter"]),
    (moa("/nonexistent/moa"), ["not a local directory"]),
    (moa(draft_tensor_parallel_size=2), ["draft_tensor_parallel_size=2"]),
])
def test_refused_with_a_message(demo_target, spec, words):
    refused(demo_target, spec, *words)


def test_vllms_own_checks_still_run(demo_target):
    refused(demo_target, moa(max_model_len=4096), "cannot be larger than")  # vLLM's length check
    refused(demo_target, moa(num_speculative_tokens=0), "greater than 0")
    spec = engine_config(demo_target, moa(max_model_len=512)).speculative_config
    assert spec.draft_model_config.max_model_len == 512  # and applies its settings


def test_directory_names_vllm_would_reinterpret(tmp_path, demo_target):
    drafter = tmp_path / "moa-eagle3-distilled"
    shutil.copytree(DEMO / "moa-tli0", drafter)
    refused(demo_target, moa(drafter), "contains 'eagle3'")


def test_moa_alone_takes_the_shipped_drafter_and_the_measured_defaults(demo_target):
    """{"method": "moa"} and nothing else: the drafter shipped for this target (signature and weight
    fingerprint), K = 4, lookup on, K by measured speed (moa_defaults.py)."""
    from vllm_moa.integration.shell.moa_defaults import DEFAULT_NUM_SPECULATIVE_TOKENS

    spec = engine_config(demo_target, {"method": "moa"}).speculative_config
    assert Path(spec.model) == DEMO / "moa-tli0" and spec.draft_model_config.hf_config.tli == 0
    assert spec.num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS == 4
    assert spec.moa_retrieval == {} and spec.moa_adaptive is True


def test_moa_alone_for_a_target_nothing_was_shipped_for_says_how_to_train_one(tmp_path):
    """The same shapes as the demo target but other weights: no shipped drafter matches the
    fingerprint, and the refusal is one line naming the command that trains one."""
    target = tmp_path / "other-weights"
    shutil.copytree(DEMO / "target", target)
    from safetensors.torch import load_file, save_file

    weights = load_file(target / "model.safetensors")
    weights = {name: tensor + 0.01 for name, tensor in weights.items()}
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    refused(str(target), {"method": "moa"}, "no MoA drafter shipped with vllm-moa was trained for this target",
            "vllm-moa train --target")
