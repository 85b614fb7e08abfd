"""Steps without drafts cost the drafter nothing: MoA skips them and catches up when drafting resumes.

vLLM runs a draft model's first pass at every step, also when it schedules no drafts (dynamic
K = 0, `num_speculative_tokens_per_batch_size`), to keep the drafter's KV cache in step. For MoA
that pass and the tap cost about as much as a drafted step's first pass, so at high concurrency,
where a K-by-batch-size schedule turns drafting off, the drafter still slowed every step.

MoA's per-token state needs no pass at all: a token's SA key/value depend on the token and its
position only, and its CA row on the target's KV at the token's slot, which the target keeps.
So at a K = 0 step the proposer only marks the step's slots stale; at the next step that drafts,
it recomputes the stale slots of the batch's requests from the tokens (SA) and the target's
cache (CA rows, LSA over the tap) before the first pass, in chunks, all requests together.

Staleness is kept per slot of the paged cache, not per request, so that prefix caching (a later
request reusing blocks filled at skipped steps), preemption and block reuse need no special case:
every slot the target writes is then either written by the drafter (fresh) or marked stale.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vllm_moa import envs
from vllm_moa.kernels.paged import split_kv_cache

CHUNK_TOKENS = 512  # tokens recomputed per call (bounds the tap's gather: [chunk, L, H_kv * 2d])


class StaleSlots:
    """Which slots of the drafter's paged caches (SA's K/V and CA's rows) lag behind the target's."""

    def __init__(self) -> None:
        self._stale: Tensor | None = None  # [num_blocks * block_size] bool, allocated at the first skip
        self.skipped_steps = 0
        self.caught_up_tokens = 0

    @property
    def any(self) -> bool:
        """Whether any step was skipped yet (before that, no slot can be stale and nothing is checked)."""
        return self._stale is not None

    def allocate(self, num_slots: int, device: torch.device) -> None:
        """One flag per slot of the paged caches (before the first skipped step)."""
        self._stale = torch.zeros(num_slots, dtype=torch.bool, device=device)

    def mark_stale(self, slots: Tensor) -> None:
        """slots [N]: the slots a skipped step's target wrote (-1 entries ignored); after allocate."""
        slots = slots.long()
        self._stale[slots[slots >= 0]] = True
        self.skipped_steps += 1

    def mark_fresh(self, slots: Tensor) -> None:
        """slots [N]: slots the drafter just wrote (-1 entries ignored)."""
        if self._stale is not None:
            slots = slots.long()
            self._stale[slots[slots >= 0]] = False

    def mark_caught_up(self, slots: Tensor) -> None:
        """slots [M]: stale slots the catch-up just recomputed."""
        self.mark_fresh(slots)
        self.caught_up_tokens += slots.shape[0]

    def stale_before(self, block_table: Tensor, block_size: int, starts: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """The stale tokens before each request's first scheduled position.

        block_table [B, max_blocks] (the drafter's KV-cache group), starts [B] host: the position of
        each request's first token this step (0 for empty rows). Returns rows [M] (the request's
        row b), positions [M] and slots [M], request by request, positions ascending.
        """
        device = block_table.device
        empty = torch.empty(0, dtype=torch.long, device=device)
        if self._stale is None or not starts or max(starts) == 0:
            return empty, empty, empty
        limit = torch.tensor(starts, dtype=torch.long, device=device)  # [B]
        positions = torch.arange(int(limit.max()), device=device)  # [P]
        rows, columns = (positions[None, :] < limit[:, None]).nonzero(as_tuple=True)  # [M']
        slots = block_table[rows, columns // block_size].long() * block_size + columns % block_size
        stale = self._stale[slots]
        return rows[stale], columns[stale], slots[stale]


def chunks(count: int, size: int = CHUNK_TOKENS) -> list[slice]:
    """[0, count) in consecutive slices of at most `size`."""
    return [slice(start, min(start + size, count)) for start in range(0, count, size)]


def skips_steps(lsa: Any) -> bool:
    """Whether steps without drafts are skipped: chains' and trees' (a tree's first pass feeds its
    levels only at a step that drafts, after the catch-up) unless VLLM_MOA_CATCH_UP=0; not for
    drafters whose rows read the target's final hidden states (lsa.reads_final_hidden: a skipped
    step's are gone)."""
    return bool(envs.VLLM_MOA_CATCH_UP) and not lsa.reads_final_hidden


def skip_step(stale: StaleSlots, sa_kv_cache: Tensor, kv_layout: Any, step_slots: Tensor) -> None:
    """A step without drafts: neither the tap nor the first pass; the step's slots [N] are stale
    until a step drafts. sa_kv_cache: SA's paged cache (sizes the flags at the first skip)."""
    if not stale.any:
        k_cache = split_kv_cache(sa_kv_cache, kv_layout)[0]  # [num_blocks, block_size, H_kv, d]
        stale.allocate(k_cache.shape[0] * k_cache.shape[1], k_cache.device)
    stale.mark_stale(step_slots)


def catch_up(stale: StaleSlots, model: Any, view: Any, target_caches: list[Tensor], kv_layout: Any,
             block_size: int, block_table: Tensor, query_start_loc: list[int], positions: Tensor) -> None:
    """Before a step drafts: SA's K/V and CA's rows of the batch's stale tokens, from the tokens
    (view: RunnerView) and the target's caches, as the skipped steps would have written them.
    model: the MoADraftModel; block_table [B, max_blocks]; query_start_loc [B + 1] host; positions [N]."""
    batch = len(query_start_loc) - 1
    first = positions[torch.tensor(query_start_loc[:-1]).clamp(max=max(positions.shape[0] - 1, 0))].tolist()
    starts = [first[b] if query_start_loc[b + 1] > query_start_loc[b] else 0 for b in range(batch)]
    rows, at, slots = stale.stale_before(block_table[:batch], block_size, starts)
    if slots.numel() == 0:
        return
    tokens = view.token_ids_at(rows, at).to(slots.device)  # [M]
    for part in chunks(slots.shape[0]):
        model.write_sa_keys_values(tokens[part], at[part], slots[part])
        model.write_rows(target_caches, kv_layout, slots[part], at[part], slots[part], None, tokens[part])
    stale.mark_caught_up(slots)
