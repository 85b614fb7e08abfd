"""Drafting a batch's sequences together (decoding/drafters.propose_all / accept_all; MoA:
kinds/moa/batched.py): over rounds of random acceptance, sequences of different lengths drafted
together grow the same trees as drafted one at a time, and after acceptance their caches are
the same; lookup merged in (HybridSession) batches its model rounds the same way."""

import random

import pytest
import torch
from tiny_models import make_target

from vllm_moa.decoding import drafters
from vllm_moa.decoding.drafters import accept_all, propose_all
from vllm_moa.decoding.engine import SpeculativeEngine
from vllm_moa.decoding.retrieval import HybridSession, Retrieval
from vllm_moa.decoding.tree import DraftSpec
from vllm_moa.kinds.moa import MoAConfig, MoADrafter, MoASession
from vllm_moa.target import TargetOutput

SPECS = {"chain": DraftSpec.chain(3), "tree": DraftSpec.tree(depth=3, top_k=3, budget=8)}
CLOSE = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


def _last(out: TargetOutput, n: int) -> TargetOutput:
    """The target's output at the last n tokens, each tensor [1, n, ...]."""
    return TargetOutput(out.logits[:, -n:], [h[:, -n:] for h in out.hidden_states],
                        [k[:, :, -n:] for k in out.keys], [v[:, :, -n:] for v in out.values])


# lookup merged in: drafting alone when it holds a continuation as long as the draft (the model
# skips the round), or always merged into the model's draft
RETRIEVAL = {"moa": None, "lookup-alone+moa": Retrieval(min_ngram=1), "lookup-merged+moa": Retrieval(min_ngram=1, alone_at=64)}


def _sessions(drafter, target, prompts, retrieval):
    sessions = [MoASession(drafter, target) for _ in prompts]
    if retrieval is not None:
        sessions = [HybridSession(s, retrieval) for s in sessions]
    for session, prompt in zip(sessions, prompts):
        ids = torch.tensor([prompt])
        session.start(ids, target(ids))
    return sessions


def _state(session):
    return (session.model if isinstance(session, HybridSession) else session).state


@pytest.mark.parametrize(("drafting", "window"), [(name, 0) for name in RETRIEVAL] + [("moa", 32)])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_sequences_drafted_together_match_drafted_alone(target, shape, drafting, window):
    """`window`: MoA's attention_window (32: the longest prompt outgrows it, the shortest not)."""
    torch.manual_seed(0)
    drafter = MoADrafter(MoAConfig(target=target.signature, tli=0, attention_window=window)).eval()
    rng = random.Random(1)
    # different lengths; the repeated ones give lookup matches (rounds lookup drafts alone or merges)
    prompts = [[rng.randrange(97) for _ in range(n)] for n in (3, 11, 6, 40)] + [[5, 6, 7, 8] * 4]
    together, alone = (_sessions(drafter, target, prompts, RETRIEVAL[drafting]) for _ in range(2))
    assert drafters.drafts_together(together)  # in one batch, not one by one
    sequences = [list(p) for p in prompts]
    spec = SPECS[shape]
    with torch.no_grad():
        for _ in range(6):
            pendings = [rng.choice([5, 6, 7, 8, rng.randrange(97)]) for _ in prompts]
            trees = propose_all(together, pendings, spec)
            expected = [s.propose(p, spec) for s, p in zip(alone, pendings)]
            for tree, reference in zip(trees, expected):
                assert tree.tokens.tolist() == reference.tokens.tolist()
                assert tree.parents == reference.parents and tree.feed_slots == reference.feed_slots
            # the target keeps a random root-to-node path of each tree
            paths = [tree.path_to(rng.randrange(tree.size)) for tree in trees]
            verified = []
            for seq, tree, path in zip(sequences, trees, paths):
                seq += tree.tokens[path].tolist()
                verified.append(_last(target(torch.tensor([seq])), len(path)))
            accept_all(together, trees, paths, verified)
            for session, tree, path, out in zip(alone, trees, paths, verified):
                session.accept(tree, path, out)
            for a, b in zip(together, alone):
                x, y = _state(a), _state(b)
                assert x.num_verified == y.num_verified and x.sa_length == y.sa_length
                for name in ("rows", "row_k", "row_v"):
                    torch.testing.assert_close(getattr(x, name), getattr(y, name), **CLOSE)
                torch.testing.assert_close(x.sa.k, y.sa.k, **CLOSE)
                torch.testing.assert_close(x.sa.v, y.sa.v, **CLOSE)
    if RETRIEVAL[drafting] is not None:  # lookup took part, in the batch as alone
        rounds = {k: sum(s.rounds[k] for s in together) for k in ("model", "merged", "retrieval")}
        assert rounds == {k: sum(s.rounds[k] for s in alone) for k in rounds}
        assert rounds["retrieval" if drafting == "lookup-alone+moa" else "merged"] > 0, rounds


def test_tli_drafters_and_mixed_kinds_draft_one_at_a_time(target):
    torch.manual_seed(0)
    tli1 = MoADrafter(MoAConfig(target=target.signature, tli=1)).eval()
    tli0 = MoADrafter(MoAConfig(target=target.signature, tli=0)).eval()
    assert not drafters.drafts_together([MoASession(tli1, target), MoASession(tli1, target)])
    assert not drafters.drafts_together([MoASession(tli0, target), MoASession(tli1, target)])
    assert not drafters.drafts_together([MoASession(tli0, target)])  # one sequence: nothing to batch
    assert SpeculativeEngine(target, tli0).drafts_together and not SpeculativeEngine(target, tli1).drafts_together
    assert not SpeculativeEngine(target, tli0, batch_drafting=False).drafts_together
