"""The command line against careless input (issue 14): every bad value is refused with a one-line
message naming the option, exit status 2 and no traceback, before any model is loaded or warmed
up; tiny temperatures are greedy decoding."""

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from vllm_moa.decoding.chain import plain_greedy_generate
from vllm_moa.demo import run_demo
from vllm_moa.shipped import SHIPPED
from vllm_moa.target import TargetModel

pytestmark = pytest.mark.skipif(not (SHIPPED / "target" / "model.safetensors").is_file(),
                                reason="this checkout ships no demo models")
CLI = [sys.executable, "-m", "vllm_moa.cli"]


def _run(*args):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def _refused(run, *words):
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    assert "Traceback" not in run.stderr and run.stderr.strip().startswith("error:"), run.stderr[-2000:]
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    for word in words:
        assert word in run.stderr, (word, run.stderr)


@pytest.mark.parametrize("args,words", [
    (["generate", "--prompt", "x", "--temperature", "inf"], ["temperature must be a finite number in [0, 100]"]),
    (["generate", "--prompt", "x", "--temperature", "1e308"], ["temperature", "1e+308"]),
    (["generate", "--prompt", "x", "--temperature", "nan"], ["temperature"]),
    (["generate", "--prompt", "x", "--prompt", "y", "--max-prompts", "-1"], ["--max-prompts must be >= 1, got -1"]),
    (["generate", "--prompt", "x", "--max-prompts", "0"], ["--max-prompts"]),
    (["generate", "--prompt", "x", "--tree", "--depth", "0"], ["--depth must be >= 1, got 0"]),
    (["generate", "--prompt", "x", "--tree", "--tree-top-k", "0"], ["--tree-top-k"]),
    (["generate", "--prompt", "x", "--num-draft", "0"], ["--num-draft must be >= 1"]),
    (["demo", "--chain", "0"], ["--chain must be >= 1"]),
    (["client", "--prompt", "x", "--temperature", "inf", "--url", "http://127.0.0.1:9"], ["temperature"]),
    (["generate", "--prompt", "x", "--drafter-weights", "fp8"], ["--drafter-weights 'fp8'", "auto, fp32, bf16, int8"]),
    (["demo", "--target", "stdlib", "--drafter-weights", "int4"], ["--drafter-weights 'int4'"]),
    (["client", "--prompt", "x", "--drafter-weights", "q8", "--url", "http://127.0.0.1:9"], ["--drafter-weights 'q8'"]),
], ids=["inf", "huge", "nan", "max-prompts-negative", "max-prompts-zero", "tree-depth", "tree-top-k", "num-draft",
        "demo-chain", "client-temperature", "generate-weights", "demo-weights", "client-weights"])
def test_bad_options_are_refused_naming_the_option(args, words):
    _refused(_run(*args), *words)


def test_tiny_temperatures_are_greedy_on_the_command_line():
    run = _run("generate", "--prompt", "def read_config(path):", "--max-new-tokens", "16", "--ignore-eos",
               "--temperature", "1e-40", "--drafter", "ngram", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    target = TargetModel.from_pretrained(SHIPPED / "target")
    ids = AutoTokenizer.from_pretrained(str(SHIPPED / "target"))("def read_config(path):")["input_ids"]
    assert json.loads(run.stdout)["results"][0]["token_ids"] == plain_greedy_generate(target, ids, 16).token_ids


def test_demo_refuses_a_prompt_too_long_before_any_warm_up(monkeypatch):
    import vllm_moa.decoding.chain as chain

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoding ran before the prompt was checked")

    monkeypatch.setattr(chain, "plain_greedy_generate", no_decoding)  # the demo's warm-up and baseline
    with pytest.raises(ValueError, match="longer than the target's context window"):
        run_demo(max_new_tokens=8, prompt="x = 1\n" * 2000, target="stdlib")
    with pytest.raises(ValueError, match="max_tokens"):
        run_demo(max_new_tokens=0, target="stdlib")
