"""What "moa" fills in for options a user leaves out (integration/shell/moa_defaults.py): no vLLM
needed, the SpeculativeConfig stands in as a namespace."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from vllm_moa.config import DrafterConfigError, read_drafter_config
from vllm_moa.integration.shell.moa_defaults import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    apply_defaults,
    requested_adaptive,
    resolve_adaptive,
    shipped_drafter_for,
    shipped_moa_drafters,
    tree_chain_k,
)
from vllm_moa.shipped import SHIPPED, SHIPPED_SMOLLM2


def signature_of(drafter_dir):
    return read_drafter_config(drafter_dir).target_signature


def test_the_drafter_shipped_for_each_target_is_found_by_its_signature():
    assert shipped_drafter_for(signature_of(SHIPPED / "moa-tli0")) == SHIPPED / "moa-tli0"
    assert shipped_drafter_for(signature_of(SHIPPED_SMOLLM2 / "moa-tli0")) == SHIPPED_SMOLLM2 / "moa-tli0"
    assert [d.name for d in shipped_moa_drafters()][:2] == ["moa-tli0", "moa-tli0"]  # TLI = 0 first


def test_same_shapes_other_weights_or_no_fingerprint_find_nothing():
    demo = signature_of(SHIPPED / "moa-tli0")
    for actual in (replace(demo, fingerprint="0" * 16), replace(demo, fingerprint="")):
        with pytest.raises(DrafterConfigError, match="vllm-moa train --target") as refused:
            shipped_drafter_for(actual)
        assert "\n" not in str(refused.value)


@pytest.mark.parametrize("value,schedule,expected", [
    (None, False, True), (None, True, False), (False, False, False), (True, False, True), (False, True, False),
])
def test_adaptive_resolution(value, schedule, expected):
    """Left out, K follows measured speed unless the user wrote a schedule (chains and trees alike)."""
    assert resolve_adaptive(value, user_schedule=schedule) is expected


@pytest.mark.parametrize("value,schedule,words", [
    ("yes", False, "must be true or false"), (1, False, "must be true or false"),
    (True, True, "num_speculative_tokens_per_batch_size"),
])
def test_adaptive_refusals_name_the_option(value, schedule, words):
    with pytest.raises(DrafterConfigError, match=words):
        resolve_adaptive(value, user_schedule=schedule)


def test_apply_defaults_fills_only_what_was_left_out():
    actual = signature_of(SHIPPED / "moa-tli0")
    spec = SimpleNamespace(model=None, num_speculative_tokens=None, moa_retrieval=None, moa_tree=None,
                           moa_adaptive=None, num_speculative_tokens_per_batch_size=None)
    apply_defaults(spec, actual)
    assert spec.model == str(SHIPPED / "moa-tli0") and spec.num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS
    assert spec.moa_retrieval == {} and spec.moa_adaptive is True and requested_adaptive(spec)
    # vLLM's schedule for the first step, before K by measured speed takes over: max_k up to 4 requests, 0 above
    assert spec.num_speculative_tokens_per_batch_size == [(1, 4, DEFAULT_NUM_SPECULATIVE_TOKENS), (5, 5, 0)]
    given = SimpleNamespace(model="/my/drafter", num_speculative_tokens=2, moa_retrieval=False, moa_tree=None,
                            moa_adaptive=False, num_speculative_tokens_per_batch_size=None)
    apply_defaults(given, actual)
    assert (given.model, given.num_speculative_tokens, given.moa_retrieval, given.moa_adaptive) == \
        ("/my/drafter", 2, False, False)
    assert given.num_speculative_tokens_per_batch_size is None and not requested_adaptive(given)
    tree = SimpleNamespace(model=None, num_speculative_tokens=16, moa_retrieval=None,
                           moa_tree={"depth": 5, "top_k": 4}, moa_adaptive=None,
                           num_speculative_tokens_per_batch_size=None)
    apply_defaults(tree, actual)  # a tree as the README writes it turns itself down too
    assert tree.moa_adaptive is True and requested_adaptive(tree)
    assert tree.num_speculative_tokens_per_batch_size == [(1, 4, 16), (5, 5, 0)]


@pytest.mark.parametrize(("depth", "budget", "chain"), [(5, 16, 4), (3, 16, 3), (4, 4, 3), (8, 2, 1), (3, 1, None)])
def test_a_tree_falls_back_to_the_chain_default_no_deeper_than_the_tree_and_below_its_budget(depth, budget, chain):
    assert tree_chain_k(depth, budget) == chain
    assert DEFAULT_NUM_SPECULATIVE_TOKENS == 4
