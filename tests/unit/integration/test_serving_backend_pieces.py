"""The vLLM client-server backend's pieces that need no engine: the worker's capture of a
request's positions (chunked, partly served from the prefix cache), its transport as bytes, a
tree's root-to-leaf paths, the nodes a round verifies (those ending in the root's KV block), and
the per-node view that acceptance and the sync read. The engine
itself: tests/integration/vllm/test_vllm_serving_backend.py."""

from __future__ import annotations

import torch

from vllm_moa.decoding.tree import DraftTree
from vllm_moa.integration.serve.verify_service import Capture, pack, unpack
from vllm_moa.integration.serve.vllm_backend import _root_to_leaf_paths, _RoundView, _subtree, _within_block


def _fill(capture: Capture, positions, layers=2, heads=1, dim=3, width=4, vocab=5):
    for p in positions:
        capture.hidden[p] = torch.full((width,), float(p))
        capture.keys[p] = torch.full((layers, heads, dim), float(p))
        capture.values[p] = torch.full((layers, heads, dim), -float(p))
        if p >= capture.logits_from:
            capture.argmax[p] = p % vocab
            if capture.want_logits:
                capture.logits[p] = torch.arange(vocab, dtype=torch.float32) + p


def test_capture_lists_what_was_computed_in_position_order():
    capture = Capture(prompt_len=10, rows_from=6, logits_from=7, want_logits=True)
    _fill(capture, [9, 8])  # a later chunk first
    _fill(capture, [6])  # position 7 was served from the prefix cache: never computed
    out = capture.result()
    assert out["row_positions"] == [6, 8, 9] and out["head_positions"] == [8, 9]
    assert out["argmax"] == [3, 4]
    assert unpack(out["hidden"])[:, 0].tolist() == [6.0, 8.0, 9.0]
    keys = unpack(out["keys"])  # [L, n, H_kv, d]
    assert keys.shape == (2, 3, 1, 3) and keys[:, 1].eq(8.0).all() and unpack(out["values"])[:, 2].eq(-9.0).all()
    assert unpack(out["logits"]).shape == (2, 5)


def test_rows_read_from_the_prefix_cache_come_without_hidden_states():
    """An open's positions the prefix cache served, read from it (K/V only): listed among the rows,
    named in rows_without_hidden, and the view's TargetOutput then has no hidden states."""
    capture = Capture(prompt_len=6, rows_from=0, logits_from=5, want_logits=False, cached_rows=True)
    for p in range(4):  # what _read_cached_rows keeps
        capture.keys[p], capture.values[p] = torch.full((2, 1, 3), float(p)), torch.full((2, 1, 3), -float(p))
    _fill(capture, [4, 5])
    out = capture.result()
    assert out["row_positions"] == list(range(6)) and out["rows_without_hidden"] == [0, 1, 2, 3]
    assert unpack(out["hidden"])[:, 0].tolist() == [0.0, 0.0, 0.0, 0.0, 4.0, 5.0]
    view = _RoundView(want_logits=False)
    view.add(0, out, lambda p, pos: pos)
    assert view.without_hidden == {0, 1, 2, 3}
    assert view.target_output(list(range(6))).hidden_states[-1] is None
    assert unpack(capture.result()["keys"])[:, 2].eq(2.0).all()
    computed_only = view.target_output([4, 5])
    assert computed_only.hidden_states[-1][0, :, 0].tolist() == [4.0, 5.0]


def test_a_moa_drafter_without_final_hidden_rows_syncs_from_kv_alone():
    """The kinds say whose sync rows a server can make from cached K/V: MoA's unless its rows read
    the final hidden state; never EAGLE-style's (its rows are hidden states)."""
    from vllm_moa import registry

    moa, eagle = registry.get("moa"), registry.get("eagle")
    plain = type("D", (), {"lsa": type("L", (), {"reads_final_hidden": False})()})()
    with_final = type("D", (), {"lsa": type("L", (), {"reads_final_hidden": True})()})()
    assert not moa.sync_reads_hidden(plain) and moa.sync_reads_hidden(with_final)
    assert eagle.sync_reads_hidden(plain)


def test_pack_round_trips_float32_tensors_as_bytes():
    x = torch.randn(3, 4, 5)
    packed = pack(x)
    assert isinstance(packed["data"], bytes) and torch.equal(unpack(packed), x)


def test_root_to_leaf_paths_cover_every_node_in_order():
    #        0
    #      1   2
    #     3 4    5
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14, 15]), [-1, 0, 0, 1, 1, 2], [0, 1, 1, 2, 2, 2], [-1] * 6)
    assert _root_to_leaf_paths(tree) == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    chain = DraftTree(torch.tensor([1, 2, 3]), [-1, 0, 1], [0, 1, 2], [-1] * 3)
    assert _root_to_leaf_paths(chain) == [[0, 1, 2]]


def test_round_view_takes_each_node_from_any_path_that_computed_it():
    paths = [[0, 1, 3], [0, 1, 4]]
    seq = 5
    first = Capture(prompt_len=seq + 3, rows_from=seq, logits_from=seq, want_logits=False)
    _fill(first, [seq, seq + 1, seq + 2])
    second = Capture(prompt_len=seq + 3, rows_from=seq, logits_from=seq, want_logits=False)
    _fill(second, [seq + 2])  # its shared nodes came from the prefix cache
    view = _RoundView(want_logits=False)
    node_of = lambda p, pos: paths[p][pos - seq]  # noqa: E731
    view.add(0, first.result(), node_of)
    view.add(1, second.result(), node_of)
    assert sorted(view.rows) == sorted(view.heads) == [0, 1, 3, 4]
    out = view.target_output([0, 1, 4])  # the accepted path
    assert len(out.keys) == 2 and out.keys[0].shape == (1, 1, 3, 3)  # L x [1, H_kv, n, d]
    assert out.keys[0][0, 0, :, 0].tolist() == [5.0, 6.0, 7.0]  # node 4: position 7 of the second prompt
    assert out.hidden_states[-1].shape == (1, 3, 4) and out.hidden_states[0] is None


def test_a_round_verifies_the_nodes_that_end_in_the_roots_kv_block():
    """Root at position 29 of 32-token blocks: depths 0-2 end at positions 29-31 (kept), depth 3
    and below would fill the block and reach the next (cut); the kept nodes form a tree whose
    paths map back to the client's node indices."""
    #        0 -> 1 -> 2 -> 3 -> 4      (a chain)
    #          \-> 5 -> 6               (a branch at depth 1)
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14, 15, 16]), [-1, 0, 1, 2, 3, 0, 5], [0, 1, 2, 3, 4, 1, 2],
                     [-1] * 7)
    assert _within_block(tree, seq=29, block_size=32) == [0, 1, 2, 5, 6]
    assert _within_block(tree, seq=64, block_size=32) == list(range(7))  # a fresh block holds them all
    assert _within_block(tree, seq=31, block_size=32) == [0]  # the root alone: the block's last position
    sub = _subtree(tree, [0, 1, 2, 5, 6])
    assert sub.tokens.tolist() == [10, 11, 12, 15, 16] and sub.parents == [-1, 0, 1, 0, 3]
    assert sub.depths == [0, 1, 2, 1, 2] and _root_to_leaf_paths(sub) == [[0, 1, 2], [0, 3, 4]]


def test_a_tree_chunk_is_planned_only_when_the_step_computes_all_its_rows():
    from vllm_moa.decoding.tree import depths_from_parents as parents_to_depths
    from vllm_moa.integration.serve.session_trees import tree_in_step

    # root at 40, 5 nodes (positions 40..44); the step computes [computed, computed + scheduled)
    assert tree_in_step(40, 5, 36, 9) == "whole"  # re-sent tokens 36..39, then the tree
    assert tree_in_step(40, 5, 40, 5) == "whole"
    assert tree_in_step(40, 5, 20, 20) == "later"  # the chunk's head only: the tree in the next step
    assert tree_in_step(40, 5, 36, 8) == "split"  # the last node left for the next step
    assert tree_in_step(40, 5, 42, 3) == "split"  # the tail of a split chunk
    assert parents_to_depths([-1, 0, 1, 0, 3, 3]) == [0, 1, 2, 1, 2, 2]
    for bad in ([0, 0], [-1, 1], [-1, 0, -1]):
        try:
            parents_to_depths(bad)
        except ValueError as err:
            assert "parents-first" in str(err)
        else:
            raise AssertionError(bad)


def test_a_live_tree_goes_in_preorder_and_its_path_comes_back_in_the_clients_nodes():
    from vllm_moa.integration.moa.tree_verification import preorder_nodes

    # root 0; children 1 (best), 2; 1's children 3, 4; 2's child 5; 3's child 6
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14, 15, 16]), [-1, 0, 0, 1, 1, 2, 3], [0, 1, 1, 2, 2, 2, 3],
                     [-1] * 7)
    order = preorder_nodes(tree)
    assert order == [0, 1, 3, 6, 4, 2, 5]  # the drafter's best path first, at a chain's positions
    work = _subtree(tree, order)
    assert work.tokens.tolist() == [10, 11, 13, 16, 14, 12, 15]
    assert work.parents == [-1, 0, 1, 2, 1, 0, 5] and work.depths == [0, 1, 2, 3, 2, 1, 2]
    path_in_chunk = [0, 1, 4]  # root, 11, 14
    assert [order[i] for i in path_in_chunk] == [0, 1, 4]
    assert [int(tree.tokens[order[i]]) for i in [0, 5, 6]] == [10, 12, 15]
    # a first chunk keeps the preorder's first nodes: closed under ancestors
    for cut in range(1, 8):
        kept = set(order[:cut])
        assert all(tree.parents[n] in kept for n in kept if n)
