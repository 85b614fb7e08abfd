"""MoA drafters as speculators checkpoints, without vLLM (issue 63, item 1): the keys a servable
drafter carries (vllm_moa/speculators_format.py), `vllm-moa speculators-config`, and how the plugin
finds a checkpoint's verifier or says in one line why it cannot
(integration/shell/speculators_checkpoints.py). Inside vLLM: tests/integration/vllm/
test_vllm_speculators_checkpoints.py (its config path) and test_vllm_cli.py (`vllm serve <drafter>`)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from typer.testing import CliRunner

from vllm_moa.cli import app
from vllm_moa.config import SPECULATORS_KEYS, DrafterConfigError, read_drafter_config
from vllm_moa.integration.shell import compat, startup_errors
from vllm_moa.integration.shell.speculators_checkpoints import (
    SpeculatorsCheckpointError,
    moa_checkpoint,
    resolve_verifier,
    update_moa,
)
from vllm_moa.kinds.moa import MoAConfig
from vllm_moa.shipped import SHIPPED, SHIPPED_SMOLLM2
from vllm_moa.speculators_format import (
    RECOMMENDED_SPECULATIVE_TOKENS,
    read_speculators_section,
    write_speculators_config,
)
from vllm_moa.targets import SMOLLM2_135M_INSTRUCT, fetched_target


@pytest.fixture
def drafter(tmp_path):
    """A copy of the demo MoA drafter (TLI 0) with its speculators keys taken out."""
    copy = tmp_path / "drafter"
    shutil.copytree(SHIPPED / "moa-tli0", copy)
    path = copy / "config.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in data.items() if k not in SPECULATORS_KEYS}))
    return copy


def test_every_shipped_moa_drafter_is_servable_by_its_directory():
    """The shipped MoA drafters name their verifier as the package finds it: the demo target beside
    them, SmolLM2 by the folder `vllm-moa fetch smollm2` converts into."""
    for directory in (SHIPPED / "moa-tli0", SHIPPED / "moa-tli1"):
        section = read_speculators_section(directory)
        assert section.algorithm == compat.METHOD == MoAConfig.SPECULATORS_ALGORITHM
        assert resolve_verifier(section.verifier.name_or_path, directory) == str((SHIPPED / "target").resolve())
        assert section.proposal.speculative_tokens == RECOMMENDED_SPECULATIVE_TOKENS
    smollm2 = read_speculators_section(SHIPPED_SMOLLM2 / "moa-tli0")
    assert smollm2.verifier.name_or_path == SMOLLM2_135M_INSTRUCT.folder_name
    assert smollm2.verifier.architectures == ["LlamaForCausalLM"]
    assert read_speculators_section(SHIPPED / "eagle") is None  # vLLM serves MoA drafters only


def test_the_keys_leave_the_drafters_own_config_as_it_was(drafter):
    before = read_drafter_config(drafter)
    keys = write_speculators_config(drafter, "/models/target", speculative_tokens=3, moa_tree={"depth": 2, "top_k": 2},
                                    moa_retrieval=False)
    after = read_drafter_config(drafter)
    assert after.to_dict() == before.to_dict() and not any(hasattr(after, key) for key in SPECULATORS_KEYS)
    section = read_speculators_section(drafter)
    assert keys["speculators_model_type"] == "moa" and section.proposal.proposal_type == "tree"
    assert section.moa_fields() == {"moa_tree": {"depth": 2, "top_k": 2}, "moa_retrieval": False}
    # what vLLM itself requires of a speculators config (SpeculatorsConfig.validate_speculators_config)
    data = json.loads((drafter / "config.json").read_text())
    assert data["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert data["speculators_config"]["verifier"]["name_or_path"] == "/models/target"
    assert isinstance(data["transformer_layer_config"], dict) and data["model_type"] == "moa_drafter"


def test_other_kinds_and_malformed_sections_are_refused_naming_the_key(tmp_path, drafter):
    eagle = tmp_path / "eagle"
    shutil.copytree(SHIPPED / "eagle", eagle)
    with pytest.raises(DrafterConfigError, match="only MoA drafters"):
        write_speculators_config(eagle, "/models/target")
    write_speculators_config(drafter, "/models/target")
    path = drafter / "config.json"
    data = json.loads(path.read_text())
    data["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(DrafterConfigError, match=r"speculators_config\.proposal_methods\.0\.speculative_tokens"):
        read_speculators_section(drafter)
    with pytest.raises(SpeculatorsCheckpointError, match="speculative_tokens"):
        moa_checkpoint(str(drafter))


def test_a_drafter_without_the_keys_gets_one_line_naming_the_command(drafter):
    with pytest.raises(SpeculatorsCheckpointError) as refused:
        moa_checkpoint(str(drafter))
    message = str(refused.value)
    assert "\n" not in message and f"vllm-moa speculators-config {drafter} --verifier" in message
    assert moa_checkpoint(str(SHIPPED / "target")) is None  # a model: vLLM goes on without the plugin
    assert moa_checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct") is None


def test_the_verifier_is_found_where_the_package_keeps_it(tmp_path, drafter, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here").mkdir()
    assert resolve_verifier("../drafter", drafter) == str(drafter.resolve())  # beside the drafter
    assert resolve_verifier("here", drafter) == str((tmp_path / "here").resolve())  # the working directory
    assert resolve_verifier("org/model", drafter) == "org/model"  # a Hugging Face id: vLLM downloads it
    with pytest.raises(SpeculatorsCheckpointError, match="/nowhere/target") as missing:
        resolve_verifier("/nowhere/target", drafter)
    assert "\n" not in str(missing.value) and "vllm-moa speculators-config" in str(missing.value)
    # a fetchable target: its cached folder, or the command that fetches it
    monkeypatch.setenv("VLLM_MOA_CACHE", str(tmp_path / "empty-cache"))
    assert fetched_target(SMOLLM2_135M_INSTRUCT.folder_name) == (None, "vllm-moa fetch smollm2")
    with pytest.raises(SpeculatorsCheckpointError, match=r"not fetched yet: run `vllm-moa fetch smollm2`"):
        resolve_verifier(SMOLLM2_135M_INSTRUCT.folder_name, drafter)


def test_vllms_speculators_registry_builds_the_drafter_from_its_keys():
    """update_moa: what vLLM's SpeculatorsConfig builds from a MoA checkpoint without model_type."""
    data = json.loads((SHIPPED / "moa-tli0" / "config.json").read_text())
    built = dict(data["transformer_layer_config"])
    update_moa(data, built)
    assert built["architectures"] == [compat.ARCHITECTURE] and built["sa_num_heads"] == data["sa_num_heads"]
    assert not set(SPECULATORS_KEYS) & set(built)


def test_the_cli_adds_the_keys_to_a_drafter_trained_before(tmp_path, drafter):
    runner = CliRunner()
    ran = runner.invoke(app, ["speculators-config", str(drafter), "--verifier", str(SHIPPED / "target"),
                              "--num-speculative-tokens", "3", "--no-lookup"])
    assert ran.exit_code == 0, ran.output
    section = read_speculators_section(drafter)
    assert section.verifier.name_or_path == str((SHIPPED / "target").resolve())  # absolute: served from anywhere
    assert section.proposal.speculative_tokens == 3 and section.moa_fields() == {"moa_retrieval": False}
    assert moa_checkpoint(str(drafter)) == section
    bad = runner.invoke(app, ["speculators-config", str(SHIPPED / "eagle"), "--verifier", "x"])
    assert bad.exit_code == 2 and "only MoA drafters" in bad.output


def test_vllm_commands_print_one_line_for_a_drafter_they_cannot_serve(monkeypatch, capsys):
    assert startup_errors.vllm_command(["/venv/bin/vllm", "serve", "d"])
    assert not startup_errors.vllm_command(["script.py"])
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args[1]))
    assert startup_errors.install(["/venv/bin/vllm", "serve", "d"])
    sys.excepthook(SpeculatorsCheckpointError, SpeculatorsCheckpointError("d is a MoA drafter ..."), None)
    assert capsys.readouterr().err == "vllm-moa: d is a MoA drafter ...\n" and not seen
    other = ValueError("not ours")
    sys.excepthook(ValueError, other, None)
    assert seen == [other]
