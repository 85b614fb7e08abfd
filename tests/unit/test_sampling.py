"""Speculative sampling is lossless: the output follows the target's own (warped) sampling
distribution, checked with a chi-square test against the exact distribution, enumerated."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from tiny_models import make_target
from vllm_moa.config import MoAConfig
from vllm_moa.decoding.chain import plain_generate, speculative_generate
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.models import MoADrafter

VOCAB, NEW_TOKENS, SAMPLES = 4, 3, 6000
PROMPT = [1, 3, 0, 2]


def exact_distribution(target, sampling):
    """P(first NEW_TOKENS tokens) under token-by-token sampling from the warped target."""
    probs = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
            logits = target(torch.tensor([PROMPT + list(seq[:-1])])).logits[0, len(PROMPT) - 1 :]
            p = sampling.probs(logits)
            probs[seq] = float(torch.prod(p[torch.arange(NEW_TOKENS), torch.tensor(seq)]))
    return probs


def chi_square_p(counts, probs):
    observed = [counts.get(seq, 0) for seq in probs if probs[seq] > 0]
    expected = [probs[seq] * SAMPLES for seq in probs if probs[seq] > 0]
    assert sum(counts.get(seq, 0) for seq in probs if probs[seq] == 0) == 0, "sampled an impossible sequence"
    scale = sum(observed) / sum(expected)
    return chisquare(observed, [e * scale for e in expected]).pvalue


@pytest.mark.parametrize("drafter_kind,sampling", [
    ("moa", SamplingParams(temperature=1.0)),
    ("ngram", SamplingParams(temperature=0.7, top_k=3, top_p=0.95)),
])
def test_speculative_sampling_matches_target_distribution(drafter_kind, sampling):
    target = make_target("llama", vocab_size=VOCAB)
    torch.manual_seed(0)
    drafter = MoADrafter(MoAConfig(target=target.signature, tli=1)).eval() if drafter_kind == "moa" else "ngram"
    probs = exact_distribution(target, sampling)
    counts: dict = {}
    accepted = 0
    for seed in range(SAMPLES):
        out = speculative_generate(target, drafter, PROMPT, NEW_TOKENS, num_draft=2, sampling=sampling, seed=seed)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        accepted += sum(out.accepted_per_forward) - len(out.accepted_per_forward)
    assert accepted > 0 and accepted < SAMPLES * 2  # both branches of the rejection rule ran
    assert chi_square_p(counts, probs) > 0.001


def test_seed_makes_sampling_reproducible():
    target = make_target("llama")
    torch.manual_seed(0)
    drafter = MoADrafter(MoAConfig(target=target.signature)).eval()
    params = SamplingParams(temperature=0.8, top_p=0.9)
    runs = [speculative_generate(target, drafter, PROMPT, 24, 3, params, seed=11).token_ids for _ in range(2)]
    assert runs[0] == runs[1]
    assert plain_generate(target, PROMPT, 24, params, seed=5).token_ids == plain_generate(target, PROMPT, 24, params, seed=5).token_ids


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1), "temperature"), (dict(top_k=-2), "top_k"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
])
def test_invalid_sampling_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
