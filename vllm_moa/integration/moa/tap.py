"""Index arithmetic of MoA's tap on vLLM's paged caches, shared by MoAProposer and the CPU tests.

All on the device, without host synchronisation and with fixed output sizes (vLLM's padded
drafter batch never syncs). Conventions are vLLM 0.26's: a step's scheduled tokens are
flattened request by request (`query_start_loc`); the last `num_rejected` tokens of a request
are drafts the target rejected; slot -1 means "do not write" (PADDING_SLOT_ID).

CA's cache layout: the slot of a verified token holds the CA key/value of that token's row
(same slot as its target KV and its SA KV, so prefix caching, preemption and chunked prefill
keep all three together).
"""

from __future__ import annotations

import torch
from torch import Tensor

PAD_SLOT = -1


def slots_of(block_table: Tensor, req: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Slots of tokens at `positions` [M] of requests `req` [M] (int64)."""
    column = (positions // block_size).clamp(max=block_table.shape[1] - 1)
    return block_table[req, column].long() * block_size + positions % block_size


def verified_mask(query_start_loc: Tensor, num_rejected: Tensor | None, num_tokens: int) -> Tensor:
    """[N] bool: which of the step's scheduled tokens the target kept (all of them when no
    drafts were verified this step)."""
    device = query_start_loc.device
    if num_rejected is None:
        return torch.ones(num_tokens, dtype=torch.bool, device=device)
    starts = query_start_loc.long()
    ends = starts[1:]
    # padded batches may list more requests than num_rejected covers: those rejected nothing
    rejected = torch.zeros_like(ends)
    rejected[: num_rejected.shape[0]] = num_rejected.long()
    token = torch.arange(num_tokens, device=device)
    req = torch.searchsorted(ends, token, right=True).clamp(max=ends.shape[0] - 1)  # [N]
    return token < (ends - rejected)[req]


def tap_write_slots(query_start_loc: Tensor, slot_mapping: Tensor, num_rejected: Tensor | None) -> Tensor:
    """Where the CA rows of the step's scheduled tokens go: their own slots [N] (the slots the
    target just wrote their KV to), -1 for rejected drafts (read, so shapes stay fixed, but
    never written)."""
    slots = slot_mapping.long()
    keep = verified_mask(query_start_loc, num_rejected, slots.shape[0])
    return torch.where(keep, slots, torch.full_like(slots, PAD_SLOT))


def row_seq_lens(seq_lens: Tensor, draft_index: int, num_rejected: Tensor | None = None) -> Tensor:
    """CA's sequence lengths: the verified count R of each request.

    First pass (draft_index 0): `seq_lens` are vLLM's extended lengths, R + 1 + num_rejected
    (the target's length plus the sampled token). Step k >= 1: vLLM has removed the rejected
    drafts and added one per step, R + 1 + k.
    """
    rows = seq_lens - 1 - draft_index
    if draft_index == 0 and num_rejected is not None:
        rows = rows - num_rejected.to(seq_lens.dtype)
    return rows.clamp(min=1)
