"""Which slots MoA's proposer recomputes after steps without drafts (integration/moa/catch_up.py),
without vLLM. The engine runs (skipped steps, catch-up, prefix-cache reuse of blocks filled at
skipped steps) are in tests/integration/vllm/test_vllm_engine.py."""

from __future__ import annotations

import torch

from vllm_moa.integration.moa.catch_up import StaleSlots, chunks

BLOCK = 4
# two requests: row 0 on blocks 5, 2; row 1 on blocks 7, 1, 3 (32 blocks of 4 slots)
TABLE = torch.tensor([[5, 2, 0], [7, 1, 3]])


def slot(row: int, position: int) -> int:
    return int(TABLE[row, position // BLOCK]) * BLOCK + position % BLOCK


def test_nothing_is_stale_before_a_step_is_skipped():
    stale = StaleSlots()
    rows, positions, slots = stale.stale_before(TABLE, BLOCK, [6, 9])
    assert not stale.any and rows.numel() == positions.numel() == slots.numel() == 0


def test_skipped_slots_are_found_per_request_before_its_first_scheduled_position():
    stale = StaleSlots()
    skipped = [slot(0, 4), slot(0, 5), slot(1, 6), slot(1, 7), -1]  # one skipped step; -1: a padded token
    stale.allocate(32 * BLOCK, torch.device("cpu"))
    stale.mark_stale(torch.tensor(skipped))
    # row 0 now schedules position 6; row 1 position 7 (its position 7 is this step's, not stale yet)
    rows, positions, slots = stale.stale_before(TABLE, BLOCK, [6, 7])
    assert rows.tolist() == [0, 0, 1] and positions.tolist() == [4, 5, 6]
    assert slots.tolist() == [slot(0, 4), slot(0, 5), slot(1, 6)]
    stale.mark_caught_up(slots)
    assert stale.caught_up_tokens == 3 and stale.stale_before(TABLE, BLOCK, [6, 7])[0].numel() == 0
    # position 7 of row 1 is still stale and is found once the request is past it
    assert stale.stale_before(TABLE, BLOCK, [0, 8])[1].tolist() == [7]


def test_a_block_reused_by_another_request_is_stale_until_written():
    """Prefix caching or block reuse: staleness belongs to the slot, whoever's table points to it."""
    stale = StaleSlots()
    stale.allocate(32 * BLOCK, torch.device("cpu"))
    stale.mark_stale(torch.tensor([slot(0, 0), slot(0, 1)]))  # row 0's block 5, positions 0-1
    other = torch.tensor([[5, 6, 0]])  # a later request whose cached prefix is block 5
    assert stale.stale_before(other, BLOCK, [3])[1].tolist() == [0, 1]


def test_chunks_cover_every_token_once():
    parts = chunks(1100, 512)
    assert [(p.start, p.stop) for p in parts] == [(0, 512), (512, 1024), (1024, 1100)]
    assert chunks(0) == []


class _LSA:
    def __init__(self, reads_final_hidden: bool) -> None:
        self.reads_final_hidden = reads_final_hidden


def test_only_drafters_without_final_hidden_rows_skip_steps(monkeypatch):
    """Chains and trees skip steps without drafts (a tree's first pass feeds its levels only at a
    step that drafts); drafters whose rows read the target's final hidden states do not."""
    from vllm_moa import envs
    from vllm_moa.integration.moa.catch_up import skips_steps

    monkeypatch.delenv("VLLM_MOA_CATCH_UP", raising=False)
    assert skips_steps(_LSA(False))
    assert not skips_steps(_LSA(True))  # a skipped step's final hidden states are gone
    monkeypatch.setenv("VLLM_MOA_CATCH_UP", "0")
    assert not envs.VLLM_MOA_CATCH_UP and not skips_steps(_LSA(False))


def test_a_skipped_step_sizes_the_flags_from_the_drafter_cache_and_marks_its_slots():
    from vllm_moa.integration.moa.catch_up import skip_step
    from vllm_moa.integration.shell.compat import packed_kv_layout

    stale = StaleSlots()
    sa_cache = torch.zeros(32, 2, BLOCK, 2 * 8)  # [num_blocks, H_kv, block_size, 2d] (FLASH_ATTN's layout)
    skip_step(stale, sa_cache, packed_kv_layout, torch.tensor([slot(0, 4), -1]))
    assert stale.any and stale.skipped_steps == 1
    rows, positions, slots = stale.stale_before(TABLE, BLOCK, [6, 0])
    assert rows.tolist() == [0] and positions.tolist() == [4] and slots.tolist() == [slot(0, 4)]
