"""The shipped demo models (vllm_moa/assets/demo): they load, they are refused against another
target, and speculative decoding with them equals the target's greedy decoding."""

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from tiny_models import make_target
from vllm_moa.config import DrafterTargetMismatch
from vllm_moa.decoding.chain import plain_greedy_generate, speculative_greedy_generate
from vllm_moa.demo import SHIPPED
from vllm_moa.models import EagleDrafter, IndependentDrafter, MoADrafter, load_drafter
from vllm_moa.target import TargetModel

pytestmark = pytest.mark.skipif(not (SHIPPED / "target" / "model.safetensors").is_file(),
                                reason="this checkout ships no demo models")
DRAFTERS = {"moa-tli0": MoADrafter, "moa-tli1": MoADrafter, "eagle": EagleDrafter, "independent": IndependentDrafter}


@pytest.fixture(scope="module")
def target():
    return TargetModel.from_pretrained(SHIPPED / "target")


def test_shipped_size_is_within_budget():
    size = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file())
    assert size <= 20 * 2**20, f"shipped models take {size / 2**20:.1f} MiB"


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_shipped_drafters_load_and_refuse_other_targets(target, name):
    drafter = load_drafter(SHIPPED / name, target)
    assert type(drafter) is DRAFTERS[name]
    assert target.num_layers >= 8
    with pytest.raises(DrafterTargetMismatch):
        load_drafter(SHIPPED / name, make_target("llama"))


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_greedy_exactness_on_shipped_models(target, name):
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED / "target"))
    drafter = load_drafter(SHIPPED / name, target).eval()
    prompts = [p["text"] for p in json.loads((SHIPPED / "heldout_prompts.json").read_text())]
    lengths = []
    for prompt in prompts[:4]:
        ids = tokenizer(prompt)["input_ids"]
        spec = speculative_greedy_generate(target, drafter, ids, 40, num_draft=5)
        assert spec.token_ids == plain_greedy_generate(target, ids, 40).token_ids
        lengths.append(spec.acceptance_length)
    assert sum(lengths) / len(lengths) > 1.5, lengths  # a trained drafter, not a random one


def test_readme_main_job_runs():
    run = subprocess.run([sys.executable, "-m", "vllm_moa.cli", "demo", "--json", "--max-new-tokens", "48"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert result["new_tokens"] == 48 and result["acceptance_length"] > 1.0 and result["speedup"] > 0


def test_generate_cli_streams_and_refuses_bad_input():
    base = [sys.executable, "-m", "vllm_moa.cli", "generate", "--prompt", "def f(x):", "--max-new-tokens", "24"]
    run = subprocess.run(base + ["--drafter", "eagle"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() and "acceptance length" in run.stderr
    sampled = subprocess.run(base + ["--temperature", "0.8", "--seed", "3", "--drafter", "ngram"],
                             capture_output=True, text=True, timeout=300)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    bad = subprocess.run(base + ["--top-k", "-1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "top_k" in bad.stderr and "Traceback" not in bad.stderr
