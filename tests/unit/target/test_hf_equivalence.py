"""Greedy exactness against transformers' own `generate` (not against this project's functional
target): tiny random Llama, Qwen2 and Mistral models, through every path of the runtime: plain
decoding over the KV cache, the engine's batched slot cache (prompts of different lengths),
chains, and draft trees whose verification runs under tree attention masks and accepts deep paths
through any branch (oracle drafters), followed by cache compaction."""

import random

import pytest
import torch
from tiny_models import make_hf_target, oracle_sessions
from transformers import GenerationConfig

from vllm_moa.decoding import engine as engine_module
from vllm_moa.decoding.chain import plain_greedy_generate
from vllm_moa.decoding.engine import SpeculativeEngine
from vllm_moa.decoding.tree import DraftSpec
from vllm_moa.kinds.eagle import EagleDrafter, EagleDrafterConfig
from vllm_moa.kinds.moa import MoAConfig, MoADrafter
from vllm_moa.target import TargetModel

NEW_TOKENS = 24
TREE = DraftSpec.tree(depth=4, top_k=3, budget=10)
FULL_TREE = DraftSpec.tree(depth=4, top_k=3, budget=30)  # every grown node kept: paths up to depth 4


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def models(request):
    hf = make_hf_target(request.param, seed=1)
    target = TargetModel(hf, name=f"tiny-{request.param}")
    rng = random.Random(4)
    prompts = [[rng.randrange(97) for _ in range(n)] for n in (1, 5, 13)]
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            expected.append(out[0, len(prompt):].tolist())
    assert all(len(e) == NEW_TOKENS for e in expected)
    return target, prompts, expected


def _drafter(kind, target):
    torch.manual_seed(0)
    if kind == "eagle":
        return EagleDrafter(EagleDrafterConfig(target=target.signature)).eval()
    return MoADrafter(MoAConfig(target=target.signature, tli=int(kind[-1]))).eval()


def test_plain_decoding_over_the_kv_cache_equals_hf_generate(models):
    target, prompts, expected = models
    assert [plain_greedy_generate(target, p, NEW_TOKENS).token_ids for p in prompts] == expected
    # the engine's batched slot cache, prompts of different lengths padded into one forward
    assert [r.token_ids for r in SpeculativeEngine(target, None).generate(prompts, NEW_TOKENS)] == expected


@pytest.mark.parametrize("spec", [DraftSpec.chain(3), TREE], ids=["chain", "tree"])
def test_speculative_decoding_equals_hf_generate(models, spec):
    target, prompts, expected = models
    for drafter in ("ngram", _drafter("moa-tli1", target)):
        results = SpeculativeEngine(target, drafter, spec).generate(prompts, NEW_TOKENS)
        assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("kind", ["moa-tli0", "moa-tli1", "eagle"])
def test_deep_tree_acceptance_equals_hf_generate(models, kind, monkeypatch):
    """Oracle drafters put the true token at a random rank among the top 3 of every level: the
    target verifies trees under their masks and accepts deep paths through any branch."""
    target, prompts, expected = models
    drafter = _drafter(kind, target)
    sessions = iter(oracle_sessions(kind, drafter, target, prompts, expected))
    monkeypatch.setattr(engine_module.kinds, "open_runtime_session", lambda _drafter, _target: next(sessions))
    results = SpeculativeEngine(target, drafter, FULL_TREE).generate(prompts, NEW_TOKENS)
    assert [r.token_ids for r in results] == expected
    accepted = [a for r in results for a in r.accepted_per_forward]  # path lengths, root included
    assert max(accepted) >= 4 and sum(accepted) / len(accepted) > 2.0  # deep paths were accepted
