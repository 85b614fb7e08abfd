"""Speculative sampling is lossless: the output follows the target's own (warped) sampling
distribution, checked with a chi-square test against the exact distribution, enumerated."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from tiny_models import make_target

from vllm_moa.decoding.chain import plain_generate, speculative_generate
from vllm_moa.decoding.engine import SpeculativeEngine
from vllm_moa.decoding.retrieval import Retrieval
from vllm_moa.decoding.sampling import SamplingParams, sample
from vllm_moa.decoding.tree import DraftSpec, DraftTree
from vllm_moa.decoding.verify import sampled_accept
from vllm_moa.kinds.moa import MoAConfig, MoADrafter

VOCAB, NEW_TOKENS = 4, 3
# Samples per engine case. 8,000 over the 64 sequences still rejects a sampler whose distribution
# is off by a total variation of ~0.06 (chi-square noncentrality ~100 at p < 0.001, power > 0.9);
# 20,000 cost 2.5x the time (minutes per case here) for a bound of ~0.04. The pure tree rule
# below keeps 20,000 (it is cheap).
SAMPLES = 8_000
PROMPT = [1, 3, 0, 2]
BATCH = 2_000  # samples drawn per engine call (one batch of identical prompts)


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


# hybrid: lookup merged into the MoA drafter's tree (decoding/retrieval.py); with min_ngram 1 on a
# 4-token vocabulary every round finds a continuation, merged (a 1-token one) or drafted alone
HYBRID = Retrieval(min_ngram=1, max_ngram=2)


# MoA drafters: TLI = 1 (one sequence at a time, the target's last layer in the draft) for the
# chain, TLI = 0 (the batch's sequences drafted together: kinds/moa/batched.py) for the others
@pytest.mark.parametrize("drafter_kind,spec,sampling,retrieval", [
    ("moa-tli1", DraftSpec.chain(2), SamplingParams(temperature=1.0), None),
    ("moa-tli0", DraftSpec.tree(depth=2, top_k=2, budget=4), SamplingParams(temperature=0.8, top_p=0.95), None),
    ("ngram", DraftSpec.tree(depth=2, top_k=2, budget=3), SamplingParams(temperature=0.7, top_k=3, top_p=0.95), None),
    ("moa-tli0", DraftSpec.chain(2), SamplingParams(temperature=1.0), HYBRID),
    ("moa-tli0", DraftSpec.tree(depth=2, top_k=2, budget=4), SamplingParams(temperature=0.8, top_p=0.95), HYBRID),
], ids=["moa-chain", "moa-tree", "ngram-tree", "hybrid-chain", "hybrid-tree"])
@pytest.mark.slow
def test_speculative_sampling_matches_target_distribution(drafter_kind, spec, sampling, retrieval):
    """8,000 sampled continuations (batches of identical prompts through the engine) follow the
    exact distribution of the target's own warped sampling."""
    target = make_target("llama", vocab_size=VOCAB)
    torch.manual_seed(0)
    drafter = "ngram" if drafter_kind == "ngram" else \
        MoADrafter(MoAConfig(target=target.signature, tli=int(drafter_kind[-1]))).eval()
    probs = exact_distribution(target, sampling)
    engine = SpeculativeEngine(target, drafter, spec, retrieval=retrieval)
    counts: dict = {}
    accepted = rejected = 0
    for seed in range(SAMPLES // BATCH):
        for out in engine.generate([PROMPT] * BATCH, NEW_TOKENS, sampling, seed=seed):
            counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
            accepted += sum(out.accepted_per_forward) - len(out.accepted_per_forward)
            rejected += sum(1 for a, d in zip(out.accepted_per_forward, out.drafted_per_forward) if a - 1 < d)
    assert sum(counts.values()) == SAMPLES
    assert accepted > 0 and rejected > 0  # both branches of the rejection rule ran
    assert chi_square_p(counts, probs) > 0.001


def test_recursive_rejection_over_point_mass_children_is_lossless():
    """The tree rule on its own: a root with three deterministic children; the next token follows p."""
    p = torch.tensor([0.05, 0.4, 0.15, 0.3, 0.1])
    tree = DraftTree(torch.tensor([0, 3, 1, 4]), [-1, 0, 0, 0], [0, 1, 1, 1], [-1, -1, -1, -1])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    target_probs = p.expand(4, 5)
    samples = 20_000
    for _ in range(samples):
        path, nxt = sampled_accept(tree, target_probs, generator)
        counts[tree.tokens[path[1]] if len(path) > 1 else nxt] += 1
    assert chisquare(counts.tolist(), (p * samples).tolist()).pvalue > 0.001


def test_seed_makes_sampling_reproducible():
    target = make_target("llama")
    torch.manual_seed(0)
    drafter = MoADrafter(MoAConfig(target=target.signature)).eval()
    params = SamplingParams(temperature=0.8, top_p=0.9)
    runs = [speculative_generate(target, drafter, PROMPT, 24, 3, params, seed=seed).token_ids for seed in (11, 11, 12)]
    assert runs[0] == runs[1] != runs[2]  # the seed, not a fixed one, decides the samples
    plain = [plain_generate(target, PROMPT, 24, params, seed=seed).token_ids for seed in (5, 5, 6)]
    assert plain[0] == plain[1] != plain[2]


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1), "temperature"), (dict(top_k=-2), "top_k"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
])
def test_invalid_sampling_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


# -- the temperature range: [0, 100], finite; below MIN_TEMPERATURE (0 included) it is greedy ----------
@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -1e-300, 100.0001, 1e308, "0.5", True])
def test_temperature_outside_the_range_is_refused_naming_it(temperature):
    with pytest.raises(ValueError, match=r"temperature must be a finite number in \[0, 100\]"):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("temperature", [0.0, 5e-324, 1e-310, 1e-40, 9.99e-6])
def test_tiny_temperatures_are_greedy(temperature):
    """Subnormal and tiny temperatures used to divide the logits into inf/nan (a crash in
    multinomial); they are greedy decoding, exactly."""
    sampling = SamplingParams(temperature=temperature)
    assert sampling.greedy
    target = make_target("llama")
    greedy = plain_generate(target, PROMPT, 12).token_ids
    assert plain_generate(target, PROMPT, 12, sampling, seed=0).token_ids == greedy
    assert SpeculativeEngine(target, "ngram", DraftSpec.tree(depth=2, top_k=2, budget=3)).generate(
        [PROMPT], 12, sampling, seed=0)[0].token_ids == greedy
    logits = torch.randn(3, 50)
    assert torch.equal(sampling.probs(logits).argmax(-1), logits.argmax(-1))  # the limit: a point mass


def test_warped_probabilities_stay_finite_for_any_valid_temperature_and_logits():
    """Fuzz: temperatures over the valid range (subnormals, the boundaries, huge ratios) and logits
    of any magnitude (fp16 extremes, -inf from masking): a proper distribution every time."""
    temperatures = st.one_of(st.floats(0, 100, allow_subnormal=True),
                             st.sampled_from([1e-5, 1.0000001e-5, 1e-4, 100.0, 5e-324, 1e-39]))
    magnitudes = st.sampled_from([1.0, 1e3, 6.5e4, 1e30, 3e38])

    @settings(max_examples=300, deadline=None, database=None)
    @given(temperature=temperatures, scale=magnitudes, top_k=st.integers(0, 8), top_p=st.sampled_from([1.0, 0.9, 1e-6]),
           seed=st.integers(0, 2**31), masked=st.booleans())
    def check(temperature, scale, top_k, top_p, seed, masked):
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(seed)) * scale
        logits = logits.clamp(-3e38, 3e38)
        if masked:
            logits[:, :5] = float("-inf")
        probs = sampling.probs(logits)
        assert torch.isfinite(probs).all() and (probs >= 0).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(2), atol=1e-5, rtol=0)
        sample(probs[:1], torch.Generator().manual_seed(seed))  # multinomial accepts it

    check()
