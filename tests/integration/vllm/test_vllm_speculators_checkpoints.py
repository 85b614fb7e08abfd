"""A MoA drafter's directory where vLLM expects a model (issue 63, item 1), through vLLM's own path
from user arguments to a VllmConfig (EngineArgs.create_engine_config, what LLM(...) and
`vllm serve` run): the verifier is served with "moa", a user's --speculative-config overrides the
checkpoint's fields, and what cannot be served is refused in one line. Run at Python level on every
tested vLLM; `vllm serve <drafter>` end to end: test_vllm_cli.py."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

from vllm_env import DEMO, engine_config  # noqa: E402

from vllm_moa.config import SPECULATORS_KEYS  # noqa: E402
from vllm_moa.integration.shell import plugin  # noqa: E402
from vllm_moa.integration.shell.speculators_checkpoints import SpeculatorsCheckpointError  # noqa: E402
from vllm_moa.speculators_format import write_speculators_config  # noqa: E402

pytestmark = pytest.mark.vllm

TARGET = str((DEMO / "target").resolve())


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert plugin.register()


@pytest.fixture
def copy_of(tmp_path):
    def copy(name: str, keys: bool = True):
        directory = tmp_path / name
        shutil.copytree(DEMO / name, directory)
        if not keys:
            path = directory / "config.json"
            data = json.loads(path.read_text())
            path.write_text(json.dumps({k: v for k, v in data.items() if k not in SPECULATORS_KEYS}))
        return directory

    return copy


def test_the_drafters_directory_alone_serves_its_verifier_with_moa():
    config = engine_config(str(DEMO / "moa-tli0"), None)
    spec = config.speculative_config
    assert config.model_config.model == TARGET
    assert spec.method == "moa" and spec.model == str(DEMO / "moa-tli0")
    # the checkpoint's K, then what "moa" fills in for the rest (moa_defaults.py)
    assert spec.num_speculative_tokens == 4 and spec.moa_retrieval == {} and spec.moa_adaptive is True


def test_a_users_speculative_config_overrides_the_checkpoints_fields(copy_of):
    drafter = copy_of("moa-tli0")
    write_speculators_config(drafter, TARGET, speculative_tokens=5, moa_tree={"depth": 2, "top_k": 2})
    from_checkpoint = engine_config(str(drafter), None).speculative_config
    assert from_checkpoint.num_speculative_tokens == 5 and from_checkpoint.moa_tree == {"depth": 2, "top_k": 2}
    overridden = engine_config(str(drafter), {"num_speculative_tokens": 3, "moa_retrieval": False,
                                              "moa_adaptive": False}).speculative_config
    assert overridden.method == "moa" and overridden.model == str(drafter)
    assert overridden.num_speculative_tokens == 3 and overridden.moa_retrieval is False
    assert overridden.moa_adaptive is False and overridden.moa_tree == {"depth": 2, "top_k": 2}


def test_a_verifier_that_cannot_be_found_is_named_in_one_line(copy_of):
    drafter = copy_of("moa-tli0")
    write_speculators_config(drafter, "/nowhere/target")
    with pytest.raises(SpeculatorsCheckpointError) as refused:
        engine_config(str(drafter), None)
    assert "'/nowhere/target'" in str(refused.value) and "\n" not in str(refused.value)


def test_a_drafter_written_before_the_keys_gets_the_command_that_adds_them(copy_of):
    drafter = copy_of("moa-tli1", keys=False)
    with pytest.raises(SpeculatorsCheckpointError, match=f"vllm-moa speculators-config {drafter} --verifier"):
        engine_config(str(drafter), None)


def test_vllms_speculators_registry_knows_moa():
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    data = json.loads((DEMO / "moa-tli0" / "config.json").read_text())
    data.pop("model_type")  # read as vLLM reads a speculators checkpoint without one
    built = SpeculatorsConfig.extract_transformers_pre_trained_config(data)
    assert built["architectures"] == ["MoADraftModel"] and built["tli"] == 0
    assert SpeculatorsConfig.extract_vllm_speculative_config(data) == {"method": "moa", "num_speculative_tokens": 4}
