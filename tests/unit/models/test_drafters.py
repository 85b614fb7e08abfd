"""Every drafter, through one interface, gives exactly the target's greedy output."""

import pytest
import torch
from tiny_models import make_target

from vllm_moa.decoding.chain import plain_greedy_generate, speculative_greedy_generate
from vllm_moa.decoding.tree import DraftSpec
from vllm_moa.kinds.eagle import EagleDrafter, EagleDrafterConfig
from vllm_moa.kinds.independent import IndependentDrafter, IndependentDrafterConfig
from vllm_moa.kinds.moa import MoAConfig, MoADrafter
from vllm_moa.kinds.ngram import NgramSession


def _drafter(kind, target):
    torch.manual_seed(0)
    if kind == "moa":
        return MoADrafter(MoAConfig(target=target.signature, tli=1)).eval()
    if kind == "eagle":
        return EagleDrafter(EagleDrafterConfig(target=target.signature)).eval()
    if kind == "independent":
        return IndependentDrafter(IndependentDrafterConfig(target=target.signature)).eval()
    return kind


@pytest.mark.parametrize("kind", ["moa", "eagle", "independent", "ngram"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_exactness_for_every_drafter(kind, family):
    target = make_target(family)
    drafter = _drafter(kind, target)
    gen = torch.Generator().manual_seed(3)
    for num_draft in (1, 3, 5):
        for _ in range(4):
            n = int(torch.randint(1, 14, (1,), generator=gen))
            prompt = torch.randint(0, 97, (n,), generator=gen).tolist()
            spec = speculative_greedy_generate(target, drafter, prompt, 20, num_draft=num_draft)
            assert spec.token_ids == plain_greedy_generate(target, prompt, 20).token_ids


def test_eagle_session_matches_its_training_forward_with_exact_rollout():
    """EAGLE's drafts from a verified prefix equal the argmax of its training forward unrolled
    over its own features (the same computation, two code paths)."""
    from vllm_moa.kinds.eagle import EagleSession
    from vllm_moa.models import TrainingBatchView
    from vllm_moa.models.masks import last_anchor

    target = make_target("llama")
    drafter = _drafter("eagle", target)
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        session = EagleSession(drafter, target)
        prefill = target(ids[:, :10])
        session.start(ids[:, :10], prefill)
        drafts = session.propose(int(ids[0, 10]), DraftSpec.chain(4)).tokens[None, 1:]
        # a sequence whose tokens after position 10 are the drafts, anchored at 9 (last verified)
        seq = torch.cat([ids[:, :11], drafts[:, :3]], dim=1)
        s = last_anchor((torch.arange(seq.shape[1]) < 10)[None])
        logits = drafter.training_forward(TrainingBatchView(seq, s, torch.zeros(1, dtype=torch.bool)), target,
                                          target(seq), rollout_passes=5).logits
    assert logits[0, 10:14].argmax(-1).tolist() == drafts[0].tolist()


def test_ngram_proposes_what_followed_the_last_match():
    session = NgramSession(max_ngram=3)
    session.history = [5, 6, 7, 8, 9, 5, 6]
    assert session.propose(7, DraftSpec.chain(3)).tokens.tolist() == [7, 8, 9, 5]  # root, then drafts
    assert session.propose(42, DraftSpec.chain(2)).tokens.tolist() == [42]  # no match: nothing drafted
    session.history = [1, 2, 3, 9, 1, 2, 4, 1, 2, 5, 1]
    tree = session.propose(2, DraftSpec.tree(depth=2, top_k=3, budget=5))
    # three matches of "1 2" -> continuations [5, 1], [4, 1], [3, 9] merged into a trie of 5 nodes
    assert tree.tokens.tolist() == [2, 5, 1, 4, 1, 3] and tree.parents == [-1, 0, 1, 0, 3, 0]
    with pytest.raises(ValueError, match="min_ngram"):
        NgramSession(max_ngram=1, min_ngram=2)


@pytest.mark.parametrize("tli", [0, 1])
def test_moa_training_forward_skips_padding_in_lsa_without_changing_real_positions(tli):
    """LSA runs on real tokens only when the batch says how long its rows are: the logits of every
    real position are those of the full (padded) computation."""
    from vllm_moa.models import TrainingBatchView
    from vllm_moa.models.masks import anchor_flags, last_anchor

    target = make_target("llama")
    torch.manual_seed(0)
    drafter = MoADrafter(MoAConfig(target=target.signature, tli=tli)).eval()
    ids = torch.randint(1, 97, (3, 18), generator=torch.Generator().manual_seed(4))
    lengths = torch.tensor([18, 11, 6])
    for row, n in enumerate(lengths.tolist()):
        ids[row, n:] = 0
    s = last_anchor(torch.stack([anchor_flags(18, 4, 5) for _ in range(3)]))
    with torch.no_grad():
        out = target(ids)
        full = drafter.training_forward(TrainingBatchView(ids, s, torch.zeros(3, dtype=torch.bool)), target, out).logits
        real = drafter.training_forward(TrainingBatchView(ids, s, torch.zeros(3, dtype=torch.bool), lengths), target,
                                        out).logits
    for row, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(real[row, :n], full[row, :n], rtol=1e-5, atol=1e-5)
