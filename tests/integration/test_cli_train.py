"""`vllm-moa train` end to end: a tiny target with its own tokenizer, on-policy data regenerated
by the target, a few hundred steps; the drafter must agree with the target far above chance."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vllm_moa.recipes.stdlib_demo import stdlib_files, train_tokenizer
from vllm_moa.training.trainer import TrainConfig


@pytest.fixture(scope="module")
def tiny_target_with_tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in stdlib_files(0, 12)]
    tokenizer = train_tokenizer(texts, 320, root / "target")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
    model.save_pretrained(root / "target")
    prompts = root / "prompts.jsonl"
    lines = [json.dumps({"turns": [t[i : i + 60]]}) for t in texts for i in range(0, 600, 120)]
    prompts.write_text("\n".join(lines[:48]) + "\n")
    corpus = root / "corpus.py"
    corpus.write_text(texts[0][:3000])
    return root


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "vllm_moa.cli", *args], capture_output=True, text=True, timeout=900)


def test_help_documents_every_option():
    """Every TrainConfig field is a flag (derived from its declaration, help included)."""
    out = subprocess.run([sys.executable, "-m", "vllm_moa.cli", "train", "--help"], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "COLUMNS": "250"}).stdout
    for name, field in TrainConfig.model_fields.items():
        if name == "drafter_options":  # the JSON --drafter-config
            continue
        assert "--" + name.replace("_", "-") in out, name
        assert field.description.split(" (")[0] in out, name
    for flag in ("--target", "--corpus", "--prompts", "--temperatures", "--resume", "--ray-workers", "--drafter-config"):
        assert flag in out


def test_cli_trained_drafter_beats_chance(tiny_target_with_tokenizer, tmp_path):
    root = tiny_target_with_tokenizer
    run = _cli("train", "--target", str(root / "target"), "--prompts", str(root / "prompts.jsonl"),
               "--corpus", str(root / "corpus.py"), "--seq-len", "64", "--response-tokens", "48",
               "--temperatures", "0,1.0", "--steps", "200", "--batch-size", "8", "--lr", "3e-3",
               "--warmup-steps", "20", "--eval-fraction", "0.15", "--output-dir", str(tmp_path / "run"),
               "--no-progress", "--checkpoint-every", "100",
               "--drafter-config", json.dumps({"lsa_intermediate_size": 64, "sa_intermediate_size": 128,
                                               "ca_intermediate_size": 128}))
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    agreement = summary["eval_agreement_by_depth"]
    chance = 1 / 320
    print("agreement by depth 0..6:", agreement)
    for depth in (1, 2, 3):
        assert agreement[depth] > 20 * chance, (depth, agreement)
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step-000200"


def test_cli_bad_input_is_a_clear_error(tiny_target_with_tokenizer, tmp_path):
    root = tiny_target_with_tokenizer
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    run = _cli("train", "--target", str(root / "target"), "--prompts", str(empty), "--output-dir", str(tmp_path / "r"))
    assert run.returncode == 2 and "holds no prompts" in run.stderr and "Traceback" not in run.stderr
    run = _cli("train", "--target", str(root / "target"), "--corpus", str(root / "corpus.py"),
               "--drafter-config", '{"sa_num_heds": 2}', "--output-dir", str(tmp_path / "r"))
    assert run.returncode == 2 and "sa_num_heds" in run.stderr and "Traceback" not in run.stderr
    run = _cli("train", "--target", str(root / "target"), "--corpus", str(root / "corpus.py"), "--resume",
               "--output-dir", str(tmp_path / "r2"))
    assert run.returncode == 2 and "no checkpoint" in run.stderr and "Traceback" not in run.stderr
