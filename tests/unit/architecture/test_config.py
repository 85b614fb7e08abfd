"""Drafter checkpoints: round trip, refusal against the wrong target, malformed configs."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import make_target

from vllm_moa.config import DrafterConfigError, DrafterTargetMismatch
from vllm_moa.kinds.eagle import EagleDrafter, EagleDrafterConfig
from vllm_moa.kinds.independent import IndependentDrafter, IndependentDrafterConfig
from vllm_moa.kinds.moa import MoAConfig, MoADrafter
from vllm_moa.models import load_drafter


@pytest.mark.parametrize("cls,config_cls", [(MoADrafter, MoAConfig), (EagleDrafter, EagleDrafterConfig),
                                            (IndependentDrafter, IndependentDrafterConfig)])
def test_round_trip(tmp_path, cls, config_cls):
    target = make_target("qwen2")
    drafter = cls(config_cls(target=target.signature))
    drafter.save_pretrained(tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", target)
    assert type(loaded) is cls
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)


def test_checkpoint_holds_no_target_weights(tmp_path):
    target = make_target("llama")
    MoADrafter(MoAConfig(target=target.signature, tli=2)).save_pretrained(tmp_path / "d")
    keys = load_file(str(tmp_path / "d" / "model.safetensors")).keys()
    assert not any("embed" in k or "lm_head" in k or "layers." in k for k in keys), sorted(keys)
    assert {k.split(".")[0] for k in keys} == {"lsa", "sa", "ca"}


def test_wrong_target_is_refused_naming_both_values(tmp_path):
    target = make_target("llama")
    MoADrafter(MoAConfig(target=target.signature)).save_pretrained(tmp_path / "d")
    other = make_target("llama", num_hidden_layers=6)
    with pytest.raises(DrafterTargetMismatch, match=r"num_layers=4.*num_layers=6"):
        MoADrafter.from_pretrained(tmp_path / "d", other)
    qwen = make_target("qwen2")
    with pytest.raises(DrafterTargetMismatch, match=r"LlamaForCausalLM.*Qwen2ForCausalLM"):
        load_drafter(tmp_path / "d", qwen)
    same_shape = make_target("llama", seed=5)
    with pytest.raises(DrafterTargetMismatch, match="fingerprint"):
        load_drafter(tmp_path / "d", same_shape)
    load_drafter(tmp_path / "d", same_shape, strict_fingerprint=False)


def _edit_config(path, **changes):
    data = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    (path / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize("changes,match", [
    (dict(sa_num_heds=4), "'sa_num_heds'"),
    (dict(sa_num_heads="four"), "'sa_num_heads'"),
    (dict(tli=9), "'tli'"),
    (dict(ca_num_heads=3), "'ca_num_heads'"),
    (dict(lsa_num_heads=7), "'lsa_num_heads'"),
    (dict(ca_head_dim=None), "ca_head_dim"),
    (dict(model_type="llama"), "'model_type'"),
    (dict(target={"architecture": "LlamaForCausalLM"}), "target"),
    (dict(target={"architecture": "LlamaForCausalLM", "num_layers": "4", "hidden_size": 64, "num_attention_heads": 4,
                  "num_kv_heads": 2, "head_dim": 16, "vocab_size": 97}), "'num_layers'"),
])
def test_malformed_config_names_the_key(tmp_path, changes, match):
    target = make_target("llama")
    MoADrafter(MoAConfig(target=target.signature)).save_pretrained(tmp_path / "d")
    _edit_config(tmp_path / "d", **changes)
    with pytest.raises(DrafterConfigError, match=match):
        load_drafter(tmp_path / "d", target)


def test_unreadable_files(tmp_path):
    target = make_target("llama")
    MoADrafter(MoAConfig(target=target.signature)).save_pretrained(tmp_path / "d")
    (tmp_path / "d" / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(DrafterConfigError, match="unreadable weights"):
        load_drafter(tmp_path / "d", target)
    (tmp_path / "d" / "config.json").write_text("{not json")
    with pytest.raises(DrafterConfigError, match="not valid JSON"):
        load_drafter(tmp_path / "d", target)
    with pytest.raises(FileNotFoundError):
        load_drafter(tmp_path / "missing", target)
