"""The property the method rests on: training-mode logits at anchor+k equal the logits of
incremental drafting k steps past that anchor (fp32, max abs diff <= 1e-4), with LSA over every
target layer or over a subset (lsa_layer_stride), with or without the final hidden state in the
rows (final_hidden_rows), with or without an attention window (attention_window); and what the
window means: a draft reads nothing older than its last W positions."""

import pytest
import torch
from tiny_models import make_target

from vllm_moa.config import DrafterConfigError
from vllm_moa.kinds.moa import MoAConfig, MoADrafter
from vllm_moa.models import TrainingBatchView
from vllm_moa.models.masks import anchor_flags, last_anchor

TOL = 1e-4


def make_drafter(target, tli, stride=1, hidden=False, window=0):
    torch.manual_seed(123)
    drafter = MoADrafter(MoAConfig(target=target.signature, tli=tli, lsa_layer_stride=stride,
                                   final_hidden_rows=hidden, attention_window=window, lsa_num_heads=4,
                                   lsa_intermediate_size=96,
                                   sa_num_heads=4, sa_num_kv_heads=2, sa_head_dim=16, sa_intermediate_size=96,
                                   ca_num_heads=4, ca_num_kv_heads=1, ca_head_dim=16, ca_intermediate_size=96))
    # scale weights up a little so the check is not trivially satisfied by near-zero logits
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1:
                p.mul_(2.0)
        if hidden:  # zero at the start (a no-op): make it count
            torch.nn.init.normal_(drafter.lsa.hidden2e.weight, std=0.2)
    return drafter.eval()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tli", [0, 1, 2])
@pytest.mark.parametrize(("stride", "hidden", "window"), [(1, False, 0), (2, False, 0), (2, True, 0), (1, False, 32)])
def test_training_mode_equals_incremental_drafting(family, tli, stride, hidden, window):
    target = make_target(family)
    drafter = make_drafter(target, tli, stride, hidden, window)
    gen = torch.Generator().manual_seed(7)
    seq_len, prompt_len, every = (40, 9, 7) if not window else (72, 9, 7)  # with a window: past it
    ids = torch.randint(0, 97, (1, seq_len), generator=gen)
    flags = anchor_flags(seq_len, prompt_len, every)[None]
    s = last_anchor(flags)
    with torch.no_grad():
        target_out = target(ids)
        train_logits = drafter.training_forward(
            TrainingBatchView(ids, s, torch.zeros(1, dtype=torch.bool)), target, target_out
        ).logits
    anchors = torch.nonzero(flags[0]).flatten().tolist()
    checked = 0
    for anchor in [a for a in anchors if a >= 2][::2] + [anchors[-1]]:
        state = drafter.new_state()
        with torch.no_grad():
            # verified prefix 0..anchor: its target K/V become CA rows; SA holds tokens 0..anchor
            drafter.extend_verified(state, [k[:, :, : anchor + 1] for k in target_out.keys],
                                    [v[:, :, : anchor + 1] for v in target_out.values],
                                    target_out.hidden_states[-1][:, : anchor + 1])
            drafter.feed(state, ids[:, : anchor + 1], target)
            k = 1
            while anchor + k < seq_len and s[0, anchor + k] == anchor:
                step_logits = drafter.draft_step(state, ids[:, anchor + k : anchor + k + 1], target)
                diff = (step_logits[0, 0] - train_logits[0, anchor + k]).abs().max().item()
                assert diff <= TOL, f"anchor {anchor}, depth {k}: max abs diff {diff}"
                checked += 1
                k += 1
    assert checked >= 10
    assert train_logits.abs().max() > 0.1


def test_rollback_then_redraft_equals_fresh_state():
    """Rolling the SA cache back and re-drafting gives the same logits as a fresh state."""
    target = make_target("llama")
    drafter = make_drafter(target, 1)
    ids = torch.randint(0, 97, (1, 20))
    with torch.no_grad():
        out = target(ids)
        kv = lambda n: ([k[:, :, :n] for k in out.keys], [v[:, :, :n] for v in out.values])  # noqa: E731
        state = drafter.new_state()
        drafter.extend_verified(state, *kv(10))
        drafter.feed(state, ids[:, :10], target)
        for i in range(10, 14):  # draft 4 tokens, then reject all but 2
            drafter.draft_step(state, ids[:, i : i + 1], target)
        drafter.rollback(state, 12)
        extra_keys, extra_values = [k[:, :, 10:12] for k in out.keys], [v[:, :, 10:12] for v in out.values]
        drafter.extend_verified(state, extra_keys, extra_values)
        got = drafter.draft_step(state, ids[:, 12:13], target)
        fresh = drafter.new_state()
        drafter.extend_verified(fresh, *kv(12))
        drafter.feed(fresh, ids[:, :12], target)
        want = drafter.draft_step(fresh, ids[:, 12:13], target)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tli", [0, 1])
def test_a_window_reads_nothing_older_than_its_last_positions(tli):
    """attention_window = W: a draft at position q reads SA entries at positions q - W + 1 .. q and
    the last W verified rows (R - W .. R - 1), as vLLM's paged attention reads them with a sliding
    window of W: overwriting every older entry of the drafter's caches (CA rows and their
    keys/values, SA keys/values) leaves its logits as they were, overwriting the oldest row it
    reads does not; without the window the first overwrite changes them too (the check can fail)."""
    target = make_target("llama")
    ids = torch.randint(0, 97, (1, 60), generator=torch.Generator().manual_seed(3))
    window, verified = 32, 50
    oldest = verified - window  # row 18: the oldest CA reads; SA at positions >= 50 reads 19 ..

    def draft(drafter, scramble_below=0):
        state = drafter.new_state()
        with torch.no_grad():
            out = target(ids[:, :verified])
            drafter.extend_verified(state, out.keys, out.values)
            drafter.feed(state, ids[:, :verified], target)
            if scramble_below:  # entries at positions < scramble_below, for the drafts at positions 50..52
                noise = torch.Generator().manual_seed(5)
                for tensor in (state.rows, state.row_k, state.row_v, state.sa.k, state.sa.v):
                    part = tensor[:, :scramble_below] if tensor is state.rows else tensor[:, :, :scramble_below]
                    part.copy_(torch.randn(part.shape, generator=noise) * 3)
            return torch.cat([drafter.draft_step(state, ids[:, verified + i : verified + i + 1], target)
                              for i in range(3)], dim=1)

    windowed = make_drafter(target, tli, window=window)
    torch.testing.assert_close(draft(windowed, oldest), draft(windowed), atol=1e-5, rtol=1e-5)
    assert (draft(windowed, oldest + 1) - draft(windowed)).abs().max() > 1e-2  # row 18 is read
    whole = make_drafter(target, tli)
    assert (draft(whole, oldest) - draft(whole)).abs().max() > 1e-2


@pytest.mark.parametrize("window", [1, 31, -4])
def test_a_window_too_narrow_for_a_draft_is_refused(window):
    with pytest.raises(DrafterConfigError, match=f"'attention_window' must be 0 .* got {window}"):
        MoADrafter(MoAConfig(target=make_target("llama").signature, attention_window=window))
