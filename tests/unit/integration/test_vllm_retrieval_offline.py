"""Lookup drafts inside vLLM, the parts that need no vLLM (integration/moa/lookup_drafts.py and the
moa_retrieval config check): which rows draft from lookup, each row's tokens so far from vLLM's
step buffers, the lookup chains and trees, and point-mass draft probabilities. The engine tests
(tests/integration/vllm/test_vllm_retrieval.py) run them for real."""

from __future__ import annotations

import pytest
import torch

from vllm_moa.decoding.retrieval import Retrieval
from vllm_moa.integration.moa.lookup_drafts import (
    LookupDrafting,
    lookup_chain,
    lookup_tree,
    one_hot_rows,
    plan_lookups,
    request_histories,
)
from vllm_moa.integration.shell.draft_config import UnsupportedMoASetup, retrieval_options

REPEATING = [5, 6, 7, 8, 9, 1, 2, 5, 6]  # pending 7: "5 6 7" occurred, followed by 8 9 1 2


def test_rows_with_a_long_enough_continuation_draft_from_lookup():
    plan = plan_lookups(Retrieval(), [REPEATING, [1, 2, 3, 4]], [7, 9], length=3, alone_at=3)
    assert plan.found[0] == [[8, 9, 1]] and plan.found[1] is None
    assert plan.rows == [0] and not plan.every_row
    # the continuation is cut at `length`; a threshold above what lookup finds leaves the row to the model
    assert plan_lookups(Retrieval(), [REPEATING], [7], length=8, alone_at=3).found[0] == [[8, 9, 1, 2, 5, 6, 7]]
    assert plan_lookups(Retrieval(), [REPEATING], [7], length=8, alone_at=8).found[0] is None
    # the option overrides the default threshold
    assert plan_lookups(Retrieval(alone_at=8), [REPEATING], [7], length=8, alone_at=2).found[0] is None
    assert plan_lookups(Retrieval(), [REPEATING, REPEATING], [7, 7], length=3, alone_at=3).every_row


def test_branches_are_the_longest_distinct_continuations():
    history = [1, 2, 3, 1, 2, 4, 4, 1]
    plan = plan_lookups(Retrieval(branches=2, min_ngram=1), [history], [2], length=3, alone_at=2)
    assert plan.found[0] == [[4, 4, 1], [3, 1, 2]]  # most recent first among equals
    tree = lookup_tree(2, plan.found[0], budget=4)
    assert tree.tokens.tolist() == [2, 4, 4, 1, 3] and tree.parents == [-1, 0, 1, 2, 0]  # cut at the budget
    assert tree.probs is None  # point masses


def test_a_short_continuation_is_padded_to_the_chain():
    assert lookup_chain([[8, 9]], 4) == [8, 9, 9, 9]
    assert lookup_chain([[8, 9, 1, 2, 5]], 3) == [8, 9, 1]


def test_histories_append_the_accepted_drafts_to_the_verified_tokens():
    verified = [[10, 11, 12], [20, 21], [30, 31, 32, 33]]
    # row 0: 3 drafts scheduled, 1 rejected; row 1: 3 drafts, all rejected; row 2: a prefill chunk
    step = [12, 40, 41, 42, 21, 50, 51, 52, 31, 32, 33]
    query_start = [0, 4, 8, 11]
    got = request_histories(verified, [3, 3, 0], step, query_start, rejected=[1, 3, 0])
    assert got == [[10, 11, 12, 40, 41], [20, 21], [30, 31, 32, 33]]
    # vLLM already trimmed the rejected drafts from the rows (disable_padded_drafter_batch)
    trimmed = request_histories(verified[:2], [3, 3], [12, 40, 41, 21], [0, 3, 4], rejected=None)
    assert trimmed == [[10, 11, 12, 40, 41], [20, 21]]


def test_lookup_rows_get_point_mass_draft_probabilities():
    probs = torch.softmax(torch.randn(3, 2, 6), dim=-1)
    before = probs.clone()
    chains = torch.tensor([[1, 2], [3, 4], [5, 0]])
    one_hot_rows(probs, [0, 2], chains)
    assert torch.equal(probs[0], torch.eye(6)[[1, 2]]) and torch.equal(probs[2], torch.eye(6)[[5, 0]])
    assert torch.equal(probs[1], before[1])


@pytest.mark.parametrize("value,words", [
    ("yes", "must be an object"),
    ({"max_ngram": 4, "width": 2}, "unknown key(s) ['width']"),
    ({"extra_nodes": 4}, "unknown key(s) ['extra_nodes']"),
    ({"min_ngram": 5, "max_ngram": 3}, "min_ngram (5) must be <= max_ngram (3)"),
    ({"alone_at": 0}, "alone_at"),
    ({"branches": "two"}, "branches"),
])
def test_bad_retrieval_options_are_refused_naming_the_problem(value, words):
    with pytest.raises(UnsupportedMoASetup, match="moa_retrieval") as err:
        retrieval_options(value)
    assert words in str(err.value)


def test_retrieval_options_default_and_off():
    assert retrieval_options(None) is None
    assert retrieval_options({}) == Retrieval()
    assert retrieval_options({"max_ngram": 6, "alone_at": 2}) == Retrieval(max_ngram=6, alone_at=2)


class _Rows:
    """The two things LookupDrafting reads of vLLM's runner per row (compat's RunnerView in the engine)."""

    def __init__(self, verified: list[list[int]], scheduled: list[int]) -> None:
        self.verified, self.scheduled = verified, scheduled

    def verified_token_ids(self, row: int) -> list[int]:
        return self.verified[row]

    def scheduled_draft_count(self, row: int) -> int:
        return self.scheduled[row]


def test_lookup_drafting_plans_a_step_and_counts_its_rounds():
    # row 0 ends "... 5 6" and the target sampled 7: "5 6 7" occurred before; row 1 has no match
    drafting = LookupDrafting(Retrieval(), tree_depth=None)
    view = _Rows([REPEATING, [1, 2, 3, 4]], [0, 0])
    step_tokens = torch.tensor([6, 4])  # one token per row (no drafts were scheduled)
    plan = drafting.plan(view, step_tokens, torch.tensor([7, 9]), [0, 1, 2], None, count=3)
    assert plan.rows == [0] and drafting.rounds == {"model": 1, "retrieval": 1}
    drafts, probs = LookupDrafting.chains(torch.tensor([[1, 1, 1], [2, 2, 2]]), plan, 3,
                                          torch.full((2, 3, 10), 0.1), torch.device("cpu"))
    assert drafts.tolist() == [[8, 9, 1], [2, 2, 2]]  # the lookup row replaced, the model's row kept
    assert probs[0].argmax(-1).tolist() == [8, 9, 1] and probs[0].sum().item() == 3.0  # point masses
    assert torch.all(probs[1] == 0.1)


def test_lookup_drafting_hands_whole_batches_to_lookup():
    drafting = LookupDrafting(Retrieval(), tree_depth=None)
    plan = drafting.plan(_Rows([REPEATING], [0]), torch.tensor([6]), torch.tensor([7]), [0, 1], None, count=3)
    drafts, probs = LookupDrafting.chains(torch.empty(1, 0, dtype=torch.long), plan, 3, None, torch.device("cpu"))
    assert plan.every_row and drafts.tolist() == [[8, 9, 1]] and probs is None
