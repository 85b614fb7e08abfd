"""Hybrid draft trees (decoding/retrieval.py): lookup over the sequence so far merged into a model
drafter's tree, or drafting alone when it has a long match. The output stays the target's own
(greedy against transformers' generate here; sampling by chi-square in test_sampling.py)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_target

from vllm_moa.decoding.engine import SpeculativeEngine
from vllm_moa.decoding.retrieval import HybridSession, Retrieval, continuations, merge_branches
from vllm_moa.decoding.tree import DraftSpec, DraftTree
from vllm_moa.kinds.eagle import EagleDrafter, EagleDrafterConfig
from vllm_moa.kinds.independent import IndependentDrafter, IndependentDrafterConfig
from vllm_moa.kinds.moa import MoAConfig, MoADrafter

# a prompt that repeats itself, so that lookup finds continuations of every length
PROMPT = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 30, 31, 5, 6, 7, 8]
NEW_TOKENS = 40


def test_continuations_longest_suffix_and_most_recent_match_first():
    history = [1, 2, 3, 9, 1, 2, 4, 7, 2]
    # with the pending 2: suffix [7, 2, 2] and [2, 2] never occurred before; [2] did, most recently
    # at index 8 (then the pending 2), then at 5 (then 4, 7), then at 1 (then 3, 9)
    assert continuations(history, 2, 3, 1, 2, 5) == [[2], [4, 7], [3, 9]]
    assert continuations(history, 2, 3, 1, 2, 1) == [[2]]
    assert continuations(history, 2, 3, 2, 2, 5) == []  # min_ngram 2: "2 2" has no earlier occurrence
    assert continuations([1, 2, 4, 7, 1, 2], 4, 3, 2, 3, 5) == [[7, 1, 2]]  # "2 4" matched: longest first
    assert continuations([1, 2, 3], 4, 3, 1, 2, 5) == []


def test_merge_branches_reuses_nodes_appends_parents_first_and_keeps_the_cap():
    tree = DraftTree(torch.tensor([10, 11, 12, 21]), [-1, 0, 1, 0], [0, 1, 2, 1], [0, 1, -1, -1])
    merged = merge_branches(tree, [[11, 12, 13, 14], [22]], max_new=2)
    assert merged.tokens.tolist() == [10, 11, 12, 21, 13, 14]  # 11 -> 12 reused; the cap stops [22]
    assert merged.parents == [-1, 0, 1, 0, 2, 4] and merged.depths == [0, 1, 2, 1, 3, 4]
    assert merged.feed_slots == [0, 1, -1, -1, -1, -1] and merged.probs is None
    assert all(merged.parents[i] < i for i in range(1, merged.size))
    assert merge_branches(tree, [[11, 12]], max_new=4) is tree  # nothing new: the model's tree as it was


def _drafters(target):
    torch.manual_seed(0)
    sig = target.signature
    return {"moa-tli0": MoADrafter(MoAConfig(target=sig, tli=0)).eval(),
            "moa-tli1": MoADrafter(MoAConfig(target=sig, tli=1)).eval(),
            "eagle": EagleDrafter(EagleDrafterConfig(target=sig)).eval(),
            "independent": IndependentDrafter(IndependentDrafterConfig(target=sig)).eval()}


@pytest.fixture(scope="module")
def target():
    return make_target("qwen2")


@pytest.fixture(scope="module")
def hf_greedy(target):
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = target.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                       do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("spec", [DraftSpec.chain(3), DraftSpec.tree(depth=3, top_k=2, budget=6)],
                         ids=["chain", "tree"])
@pytest.mark.parametrize("name", ["moa-tli0", "moa-tli1", "eagle", "independent"])
def test_hybrid_greedy_equals_transformers_generate(target, hf_greedy, name, spec):
    drafter = _drafters(target)[name]
    engine = SpeculativeEngine(target, drafter, spec, retrieval=Retrieval(min_ngram=1))
    batch = engine.start([PROMPT, PROMPT[:9]], [NEW_TOKENS, NEW_TOKENS])
    while batch.step():
        pass
    assert batch.results[0].token_ids == hf_greedy
    rounds = batch.sequences[0].session.rounds
    # the repetitive prompt makes every source draft at least once: retrieval alone, merged, model
    assert rounds["retrieval"] > 0 and rounds["merged"] + rounds["model"] > 0, rounds
    # lookup's drafts are accepted: more tokens per target forward than the untrained model alone
    alone = SpeculativeEngine(target, drafter, spec).generate([PROMPT], NEW_TOKENS)[0]
    assert alone.token_ids == hf_greedy
    assert batch.results[0].acceptance_length > alone.acceptance_length


def test_merged_rounds_keep_the_model_tree_and_add_lookup_branches(target, hf_greedy):
    drafter = _drafters(target)["moa-tli0"]
    spec = DraftSpec.tree(depth=3, top_k=2, budget=6)
    engine = SpeculativeEngine(target, drafter, spec, retrieval=Retrieval(min_ngram=1, alone_at=64))
    batch = engine.start([PROMPT], [NEW_TOKENS])
    session = batch.sequences[0].session
    rounds = []  # (the model's tree, the tree verified)
    model_propose, hybrid_propose = session.model.propose, session.propose

    def model_spy(*args, **kwargs):
        rounds.append([model_propose(*args, **kwargs)])
        return rounds[-1][0]

    def hybrid_spy(*args, **kwargs):
        tree = hybrid_propose(*args, **kwargs)
        rounds[-1].append(tree)
        return tree

    session.model.propose, session.propose = model_spy, hybrid_spy
    while batch.step():
        pass
    assert batch.results[0].token_ids == hf_greedy
    assert session.rounds["retrieval"] == 0 and session.rounds["merged"] > 0  # alone_at=64: the model always runs
    assert len(rounds) == sum(session.rounds.values())
    grown = 0
    for model_tree, verified in rounds:
        n = model_tree.size
        assert verified.tokens[:n].tolist() == model_tree.tokens.tolist() and verified.parents[:n] == model_tree.parents
        assert verified.feed_slots[:n] == model_tree.feed_slots and set(verified.feed_slots[n:]) <= {-1}
        assert verified.size - n <= spec.depth  # extra_nodes defaults to the draft depth
        grown += verified.size > n
    assert grown == session.rounds["merged"]


def test_bad_retrieval_options_are_refused_naming_them(target):
    with pytest.raises(ValueError, match="min_ngram"):
        Retrieval(min_ngram=5, max_ngram=3)
    with pytest.raises(ValueError, match="extra_nodes"):
        Retrieval(extra_nodes=0)
    with pytest.raises(ValueError, match="n-gram lookup alone is the 'ngram' drafter"):
        SpeculativeEngine(target, "ngram", DraftSpec.chain(3), retrieval=Retrieval())
    with pytest.raises(ValueError, match="no model session"):
        HybridSession(object(), Retrieval())


def _rows(out, nodes):
    """The target's output at positions `nodes` of one sequence, as verification hands it over."""
    from vllm_moa.target import TargetOutput

    index = torch.tensor(nodes)
    return TargetOutput(out.logits.index_select(1, index), [h.index_select(1, index) for h in out.hidden_states],
                        [k.index_select(2, index) for k in out.keys], [v.index_select(2, index) for v in out.values])


@pytest.mark.parametrize("name", ["moa-tli0", "moa-tli1", "eagle", "independent"])
def test_a_round_drafted_by_lookup_alone_leaves_the_drafter_as_if_it_had_seen_the_tokens(target, name):
    """After a round the model did not draft (lookup alone), its state equals a fresh session's
    over the same verified tokens: its next proposal is the same tree."""
    from vllm_moa import registry

    drafter = _drafters(target)[name]
    spec = DraftSpec.tree(depth=3, top_k=2, budget=6)
    session = HybridSession(registry.open_runtime_session(drafter, target), Retrieval(min_ngram=1, alone_at=1))
    prompt = PROMPT[:11]  # 5 6 7 8 9 10 11 5 6 7 8
    with torch.no_grad():
        session.start(torch.tensor([prompt]), target(torch.tensor([prompt])))
        model_round = session.propose(9, spec)  # pending 9: "7 8 9" occurred before, then "10 11 5"
        assert session.rounds == {"model": 0, "merged": 0, "retrieval": 1} and model_round.tokens[1] == 10
        path = [0, 1, 2]  # the root 9 and two accepted drafts, 10 11
        tokens = prompt + model_round.tokens[path].tolist()
        full = target(torch.tensor([tokens]))
        session.accept(model_round, path, _rows(full, list(range(len(prompt), len(tokens)))))
        fresh = registry.open_runtime_session(drafter, target)
        fresh.start(torch.tensor([tokens]), full)
        mine, theirs = session.model.propose(5, spec), fresh.propose(5, spec)
    assert mine.tokens.tolist() == theirs.tokens.tolist() and mine.parents == theirs.parents
