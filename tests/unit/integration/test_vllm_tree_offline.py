"""Draft trees inside vLLM, the parts that need no vLLM (integration/moa/tree_verification.py): the step's plan
(RoPE positions by depth), the tree mask in the target's attention over vLLM's CPU_ATTN cache
layout, acceptance with the accepted path's KV moved to the chain's slots, and the moa_tree
config checks. The engine tests (tests/integration/vllm/test_vllm_tree.py) run them for real."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vllm_moa.decoding.tree import DraftSpec, DraftTree
from vllm_moa.integration.moa.tree_or_chain import TreeOrChain
from vllm_moa.integration.moa.tree_verification import DraftedTrees, pad_tree, plan_step
from vllm_moa.integration.shell import compat
from vllm_moa.integration.shell.draft_config import UnsupportedMoASetup, requested_chain_if_faster, tree_spec
from vllm_moa.kernels.paged import split_kv_cache

H, H_KV, D, BLOCK = 4, 2, 32, 32
LAYER = SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
#           root  n1 n2 n3 n4 n5 n6
PARENTS = [-1, 0, 0, 1, 1, 2, 3]  # node 6 is a grandchild of node 1; node 5 hangs off node 2
TOKENS = [0, 11, 12, 13, 14, 15, 16]


def _drafted(req_id: str = "a", parents=PARENTS, tokens=TOKENS) -> DraftedTrees:
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    drafted = DraftedTrees()
    drafted.by_request[req_id] = DraftTree(torch.tensor(tokens), list(parents), depths, [-1] * len(parents))
    return drafted


def _step(prefix: int, lead: int = 3, positions: torch.Tensor | None = None, drafted: DraftedTrees | None = None,
          layout=compat.cpu_vec_kv_layout):
    """One request 'a' at batch row 1, after a request 'b' of `lead` tokens: its root at row lead,
    its 6 nodes at rows lead+1 .. lead+6; positions as vLLM lays out chains."""
    n = len(PARENTS)
    qsl = np.array([0, lead, lead + n])
    num_computed = np.array([40, prefix])
    if positions is None:
        positions = torch.cat([torch.arange(40, 40 + lead), torch.arange(prefix, prefix + n)])
    step = plan_step(drafted or _drafted(), {"a": TOKENS[1:]}, {"b": 0, "a": 1}, qsl, num_computed, positions,
                     frozenset([LAYER.layer_name]), layout)
    return step, positions


def test_plan_gives_tree_rows_positions_by_depth_and_leaves_chains_alone():
    step, positions = _step(prefix=50)
    assert step is not None and step.node_rows.tolist() == [4, 5, 6, 7, 8, 9]
    assert positions[:3].tolist() == [40, 41, 42]  # the other request: untouched
    assert positions[3:].tolist() == [50, 51, 51, 52, 52, 52, 53]  # root at p, nodes at p + depth
    assert step.chain_positions.tolist() == [51, 52, 53, 54, 55, 56]
    assert step.prefix_lens.tolist() == [51] and step.cu_nodes.tolist() == [0, 6]
    # a chain-shaped tree, tokens the scheduler did not get from this tree, or no tree: vLLM's chain
    for drafted, scheduled in ((_drafted(parents=list(range(-1, 6))), TOKENS[1:]),
                               (_drafted(), [99] + TOKENS[2:]), (DraftedTrees(), TOKENS[1:])):
        positions = torch.arange(7)
        assert plan_step(drafted, {"a": scheduled}, {"a": 0}, np.array([0, 7]), np.array([0]), positions,
                         frozenset(), compat.cpu_vec_kv_layout) is None
        assert positions.tolist() == list(range(7))
    # the scheduler cut the drafts to the first 3 nodes: a tree still (parents-first order)
    step = plan_step(_drafted(), {"a": TOKENS[1:4]}, {"a": 0}, np.array([0, 4]), np.array([9]), torch.arange(9, 13),
                     frozenset(), compat.cpu_vec_kv_layout)
    assert step.requests[0].tree.parents == [-1, 0, 0, 1]


def _cpu_cache(num_blocks: int = 6) -> torch.Tensor:
    torch.manual_seed(0)
    # CPU_ATTN "vec" and the GPU backends (FLASH_ATTN, TRITON_ATTN) allocate [blocks, H_kv, block, 2d];
    # the layouts differ in how K and V sit inside (compat.cpu_vec_kv_layout / packed_kv_layout)
    return torch.randn(num_blocks, H_KV, BLOCK, 2 * D)


def _attend(step, cache, block_table, query):
    output = torch.full((query.shape[0], H * D), float("nan"))
    step.attend(LAYER, D ** -0.5, query, cache, block_table, output)
    return output.view(-1, H, D)


def _expected(cache, block_row, prefix_len, first_node_pos, node, q, layout=compat.cpu_vec_kv_layout):
    """Plain attention of node's query over prefix + the node's own path, read from the cache."""
    k, v = split_kv_cache(cache, layout)
    path, at = [], node
    while at > 0:
        path.append(at)
        at = PARENTS[at]
    positions = list(range(prefix_len)) + [first_node_pos + i - 1 for i in reversed(path)]
    pos = torch.tensor(positions)
    blk, off = block_row[pos // BLOCK].long(), pos % BLOCK
    keys = k[blk, off].repeat_interleave(H // H_KV, dim=1).transpose(0, 1)  # [H, n, d]
    values = v[blk, off].repeat_interleave(H // H_KV, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(q[:, None], keys, values)[:, 0]  # [H, d]


# (backend, its cache layout, the kernels the worker runs there): CPU_ATTN takes the planned PyTorch
# path; the GPU backends take the Triton tree kernel, run here under TRITON_INTERPRET=1 on CPU tensors
BACKEND_PATHS = [("CPU_ATTN", compat.cpu_vec_kv_layout, "auto"), ("TRITON_ATTN", compat.packed_kv_layout, "triton"),
                 ("FLASH_ATTN", compat.packed_kv_layout, "triton")]


@pytest.mark.parametrize(("backend", "layout", "kernels"), BACKEND_PATHS, ids=[b[0] for b in BACKEND_PATHS])
def test_tree_mask_lets_a_node_see_the_prefix_and_its_ancestors_only(backend, layout, kernels, monkeypatch):
    """Each node row equals attention over exactly its prefix and its own path; changing the KV
    of a node that is not its ancestor leaves it unchanged, changing an ancestor's does not."""
    from vllm_moa.kernels import HAS_TRITON

    if kernels == "triton" and not HAS_TRITON:
        pytest.skip("Triton is not installed")
    monkeypatch.setenv("VLLM_MOA_KERNELS", kernels)
    assert compat.kv_layout_for_backend(backend, "vec") is layout
    prefix = 45  # the root at position 45, nodes at 46 .. 51: the tree straddles blocks 1 and 2
    step, _ = _step(prefix, layout=layout)
    cache = _cpu_cache()
    block_table = torch.tensor([[0, 1, 2, 3], [4, 2, 5, 3]], dtype=torch.int32)  # request a: blocks 4, 2, 5
    torch.manual_seed(1)
    query = torch.randn(10, H, D)
    got = _attend(step, cache, block_table, query)
    assert torch.isnan(got[:4]).all()  # rows of the other request and the root: vLLM's, untouched
    for node in range(1, 7):
        want = _expected(cache, block_table[1], prefix + 1, prefix + 1, node, query[3 + node], layout)
        torch.testing.assert_close(got[3 + node], want, rtol=1e-5, atol=1e-5)
    k, _ = split_kv_cache(cache, layout)
    for other in range(1, 7):  # perturb node `other`'s key where vLLM wrote it (position prefix + other)
        pos = prefix + other
        perturbed = cache.clone()
        split_kv_cache(perturbed, layout)[0][int(block_table[1, pos // BLOCK]), pos % BLOCK] += 5.0
        changed = _attend(step, perturbed, block_table, query)
        for node in range(1, 7):
            ancestors, at = set(), node
            while at > 0:
                ancestors.add(at)
                at = PARENTS[at]
            moved = not torch.allclose(changed[3 + node], got[3 + node])
            assert moved == (other in ancestors), (node, other)
    assert k.shape[1] == BLOCK


def test_attend_skips_the_drafters_layers():
    step, _ = _step(45)
    output = torch.zeros(10, H * D)
    step.attend(SimpleNamespace(layer_name="model.layers.8.sa.attn"), 1.0, torch.randn(10, H, D), _cpu_cache(),
                torch.zeros(2, 4, dtype=torch.int32), output)
    assert not output.any()


def _logits_choosing(choice: dict[int, int], rows: int, vocab: int = 32) -> torch.Tensor:
    logits = torch.zeros(rows, vocab)
    for row, token in choice.items():
        logits[row, token] = 5.0
    return logits


def test_greedy_accept_walks_the_tree_and_moves_the_path_to_the_chains_slots():
    prefix = 45
    step, positions = _step(prefix)
    caches = [_cpu_cache(), _cpu_cache() * 2]
    before = [c.clone() for c in caches]
    slot_mapping = torch.cat([torch.arange(3), 100 + torch.arange(7)])  # request a: root 100, nodes 101..106
    # target's argmax: after the root -> token 12 (node 2), after node 2 -> 15 (node 5), after node 5 -> 7
    # request b has 2 logit rows (one draft), request a's 7 rows start at logit 2
    logits = torch.cat([_logits_choosing({0: 3, 1: 4}, 2), _logits_choosing({0: 12, 2: 15, 5: 7}, 7)])
    cu_num_sampled = torch.tensor([2, 9])
    sampled = torch.tensor([[3, -1, -1, -1, -1, -1, -1], [11, 13, 16, -1, -1, -1, -1]], dtype=torch.int32)
    input_ids = torch.tensor([1, 2, 3, 10, 11, 12, 13, 14, 15, 16], dtype=torch.int32)
    sampling = SimpleNamespace(all_greedy=True)
    step.accept(logits, cu_num_sampled, sampling, sampled, caches, slot_mapping, input_ids, positions)
    assert sampled[1].tolist() == [12, 15, 7, -1, -1, -1, -1]  # path 2 -> 5, then the target's 7
    assert sampled[0].tolist() == [3, -1, -1, -1, -1, -1, -1]  # not a tree request: vLLM's row
    assert input_ids[3:6].tolist() == [10, 12, 15]  # the step's rows read as the chain root, 12, 15
    assert positions[4:].tolist() == [46, 47, 48, 49, 50, 51]  # chain positions restored
    for cache, old in zip(caches, before):
        k, v = split_kv_cache(cache, compat.cpu_vec_kv_layout)
        k0, v0 = split_kv_cache(old, compat.cpu_vec_kv_layout)
        for dst, src in ((101, 102), (102, 105)):  # chain slot <- node slot
            torch.testing.assert_close(k[dst // BLOCK, dst % BLOCK], k0[src // BLOCK, src % BLOCK])
            torch.testing.assert_close(v[dst // BLOCK, dst % BLOCK], v0[src // BLOCK, src % BLOCK])
        untouched = [s for s in range(6 * BLOCK) if s not in (101, 102)]
        blk, off = torch.tensor(untouched) // BLOCK, torch.tensor(untouched) % BLOCK
        assert torch.equal(k[blk, off], k0[blk, off]) and torch.equal(v[blk, off], v0[blk, off])


def test_pad_tree_fills_the_budget_with_root_children():
    tree = _drafted().by_request["a"]
    padded = pad_tree(tree, 8)
    assert padded.size == 9 and padded.parents[-2:] == [0, 0] and padded.tokens[-2:].tolist() == [11, 11]
    assert pad_tree(tree, 6) is tree


@pytest.mark.parametrize("moa_tree,budget,tli,version,words", [
    ({"depth": 3}, 8, 0, "0.32.0", "top_k must be an integer"),
    ({"depth": 3, "top_k": 2, "width": 4}, 8, 0, "0.32.0", "unknown key(s) ['width']"),
    ({"depth": 2, "top_k": 2}, 30, 0, "0.32.0", "exceeds the 6 nodes"),
    ({"depth": 5, "top_k": 8}, 65, 0, "0.32.0", "at most 64 nodes"),
    ({"depth": 5, "top_k": 4}, 16, 1, "0.32.0", "TLI=1"),
    ({"depth": 5, "top_k": 4}, 16, 0, "0.30.0", "vLLM 0.30.0"),
    ([5, 4], 16, 0, "0.32.0", "must be an object"),
    ({"depth": True, "top_k": 4}, 16, 0, "0.32.0", "depth must be an integer"),
    ({"depth": 3, "top_k": 2, "chain_if_faster": "yes"}, 4, 0, "0.32.0", "chain_if_faster must be true or false"),
])
def test_tree_config_refusals_name_the_problem(moa_tree, budget, tli, version, words):
    with pytest.raises(UnsupportedMoASetup) as err:
        tree_spec(moa_tree, budget, tli, version)
    assert words in str(err.value)


def test_tree_config():
    spec = tree_spec({"depth": 5, "top_k": 4}, 16, 0, "0.32.0")
    assert (spec.depth, spec.top_k, spec.budget) == (5, 4, 16)
    assert tree_spec({"depth": 5, "top_k": 4}, 16, 0, "0.26.0") == spec  # the lent GPUs' vLLM
    assert tree_spec({"depth": 5, "top_k": 4, "chain_if_faster": True}, 16, 0, "0.32.0") == spec
    assert tree_spec(None, 16, 1, "0.26.0") is None
    config = SimpleNamespace(moa_tree={"depth": 3, "top_k": 2, "chain_if_faster": True})
    assert requested_chain_if_faster(config)
    assert requested_chain_if_faster(SimpleNamespace(moa_tree={"depth": 3, "top_k": 2}))  # the default
    assert not requested_chain_if_faster(SimpleNamespace(moa_tree={"depth": 3, "top_k": 2, "chain_if_faster": False}))
    assert not requested_chain_if_faster(SimpleNamespace(moa_tree=None))


def _run_tree_or_chain(seconds_per_step: dict[str, float], accepted: dict[str, int], steps: int = 400,
                       batch: int = 2, budget: int = 4) -> tuple[TreeOrChain, list[DraftSpec]]:
    """Steps of a synthetic engine: each proposal's shape verified in `seconds_per_step[shape]`
    with `accepted[shape]` drafts accepted per request; every 50th step a request joins (a step
    the chooser must not price)."""
    clock = [0.0]
    chooser = TreeOrChain(DraftSpec.tree(3, 2, budget), budget, clock=lambda: clock[0])
    ids, chosen, spec = [f"r{i}" for i in range(batch)], [], None
    for step in range(steps):
        joined = step % 50 == 49
        if joined:
            ids = ids + [f"r{step}"]
        query_lens = [budget + 1] * len(ids) if spec is not None and not joined else [1] * len(ids)
        shape = None if spec is None else ("chain" if spec.is_chain else "tree")
        rejected = [budget - accepted[shape] if shape else 0] * len(ids)
        spec = chooser.next_spec(ids, query_lens, rejected)
        chosen.append(spec)
        clock[0] += seconds_per_step["chain" if spec.is_chain else "tree"] * (10 if joined else 1)
        if joined:
            ids = ids[:batch]
    return chooser, chosen


def test_tree_or_chain_prices_only_full_steps_of_the_same_requests():
    """A step is priced (tokens / seconds since the last proposal, for the last proposal's shape)
    only when it verified the full budget of exactly the last proposal's requests."""
    clock = [0.0]
    chooser = TreeOrChain(DraftSpec.tree(3, 2, 4), 4, clock=lambda: clock[0])
    first = chooser.next_spec(["a", "b"], [9, 1], None)  # after a prefill step: nothing to price
    assert not first.is_chain  # both shapes untried: the tree first
    clock[0] = 0.5
    chooser.next_spec(["a", "b"], [5, 5], [1, 2])  # prices the tree: (5 - 1) + (5 - 2) = 7 tokens in 0.5 s
    assert chooser.choice.rate(2, "tree") == pytest.approx(14.0) and chooser.choice.rate(2, "chain") is None
    clock[0] = 1.5
    chooser.next_spec(["a", "b", "c"], [5, 5, 1], [0, 0, 0])  # a request joined: not priced
    clock[0] = 2.5
    chooser.next_spec(["a", "b", "c"], [5, 3, 5], [0, 0, 0])  # a schedule cut short: not priced
    clock[0] = 3.5
    chooser.next_spec(["a", "c"], [5, 5], [0, 0])  # b left: not priced
    assert set(chooser.choice.sums) == {(2, "tree")} and chooser.choice.sums[(2, "tree")][0] == 1


@pytest.mark.parametrize("faster", ["tree", "chain"])
def test_tree_or_chain_drafts_the_shape_that_measures_faster(faster):
    """The tree accepts 3 drafts, the chain 2; their steps cost what makes `faster` win by 10%.
    The chooser must settle on it (probes aside) and never price a step a new request joined
    (those take 10x as long: priced, they would turn the verdict)."""
    chain_rate = (1 + 2) / 0.01  # tokens per second per request
    tree_s = (1 + 3) / (chain_rate * (1.1 if faster == "tree" else 1 / 1.1))
    chooser, chosen = _run_tree_or_chain({"tree": tree_s, "chain": 0.01}, {"tree": 3, "chain": 2})
    late = chosen[100:]
    share = sum(spec.is_chain == (faster == "chain") for spec in late) / len(late)
    assert share > 0.9, f"{faster} chosen in {share:.0%} of the late steps"
    slower = "tree" if faster == "chain" else "chain"
    assert chooser.choice.rate(2, faster) > chooser.choice.rate(2, slower)
    assert chooser.specs["chain"].depth == 4 and chooser.specs["tree"].depth == 3
    assert set(chooser.specs) == {"tree", "chain"} and chooser.specs["chain"].budget == 4


def _sampling(**changes):
    processors = SimpleNamespace(all=[])
    base = dict(max_num_logprobs=None, no_penalties=True, allowed_token_ids_mask=None, bad_words_token_ids={},
                logitsprocs=processors)
    return SimpleNamespace(**{**base, **changes})


def test_steps_that_need_vllms_chain_rows_are_verified_as_chains():
    from vllm_moa.integration.moa.tree_verification import chain_only_reason

    class LogitBiasLogitsProcessor:  # vLLM's built-in, by name; active when a request sets biases
        def __init__(self, biases):
            self.biases = biases

    class CustomProcessor:
        pass

    assert chain_only_reason(_sampling(), False) is None
    assert chain_only_reason(_sampling(logitsprocs=SimpleNamespace(all=[LogitBiasLogitsProcessor({})])), False) is None
    # logprobs in vLLM's raw modes (the default) are computed along the accepted path: trees stay trees
    assert chain_only_reason(_sampling(max_num_logprobs=2), False) is None
    assert chain_only_reason(_sampling(max_num_logprobs=0), False, "raw_logits") is None
    assert chain_only_reason(_sampling(max_num_logprobs=0), False, "processed_logprobs") == \
        "logprobs in mode processed_logprobs"
    cases = {"structured output": (_sampling(), True),
             "penalties": (_sampling(no_penalties=False), False),
             "allowed or bad token ids": (_sampling(bad_words_token_ids={0: [[5]]}), False),
             "logits processor LogitBiasLogitsProcessor": (
                 _sampling(logitsprocs=SimpleNamespace(all=[LogitBiasLogitsProcessor({0: {3: 1.0}})])), False),
             "logits processor CustomProcessor": (_sampling(logitsprocs=SimpleNamespace(all=[CustomProcessor()])), False)}
    for reason, (sampling, structured) in cases.items():
        assert chain_only_reason(sampling, structured) == reason


def test_preorder_puts_the_best_path_first_and_keeps_parents_first():
    from vllm_moa.integration.moa.tree_verification import preorder

    ordered = preorder(_drafted().by_request["a"])
    # root; 1 (best child) with its subtree 3 -> 6, then 4; then 2 with 5
    assert ordered.tokens.tolist() == [0, 11, 13, 16, 14, 12, 15]
    assert ordered.parents == [-1, 0, 1, 2, 1, 0, 5] and ordered.depths == [0, 1, 2, 3, 2, 1, 2]
    assert all(p < i for i, p in enumerate(ordered.parents))


def test_tree_setup_refuses_what_acts_on_chain_verification():
    from vllm_moa.integration.shell.draft_config import check_tree_setup

    check_tree_setup(SimpleNamespace(num_speculative_tokens_per_batch_size=None, rejection_sample_method="standard"), None)
    for spec, kv, word in ((SimpleNamespace(num_speculative_tokens_per_batch_size=[(1, 8, 4)]), None, "per_batch_size"),
                           (SimpleNamespace(rejection_sample_method="synthetic"), None, "rejection_sample_method"),
                           (SimpleNamespace(), object(), "kv_transfer_config")):
        with pytest.raises(UnsupportedMoASetup, match=word):
            check_tree_setup(spec, kv)


def test_a_tree_engine_scheduled_no_more_drafts_than_its_depth_drafts_the_chain():
    """K by measured speed schedules a tree engine's chains as K <= its depth (adaptive_k.py): those
    steps draft the chain loop's K tokens and drop the trees of earlier steps, so that no step
    verifies a stale tree; K = 0 drafts nothing and the whole budget the tree."""
    from vllm_moa.integration.moa.tree_drafts import TreeDrafting

    trees = TreeDrafting(DraftSpec.tree(5, 4, 16), 16, True, logger=None)
    trees.drafted = _drafted()
    assert not trees.drafts_chain(0) and not trees.drafts_chain(16) and not trees.drafts_chain(6)
    assert trees.drafted.by_request  # a tree step keeps the trees verification reads
    assert all(trees.drafts_chain(k) for k in (1, 4, 5))
    assert not trees.drafted.by_request
    chain_shaped = TreeDrafting(DraftSpec.tree(4, 1, 4), 4, False, logger=None)
    assert chain_shaped.drafts_chain(3) and not chain_shaped.drafts_chain(4)
