"""MoA drafting for a batch of sequences in one forward per tree level (the runtime at batch > 1;
TLI = 0 drafters).

Each sequence keeps its own MoADraftState (its verified tokens' CA rows and SA cache, of its own
length). A round pads them once into batch tensors:

    SA cache   [B, H_kv, C, d]   C = the longest verified prefix; sequence b's first R_b columns
    CA k/v     [B, H_kv, R, d]   R = C; columns >= R_b masked
    + per level, n = the widest frontier of the level: new SA columns C .. C + n - 1 (sequence b
      uses its first n_b of them; the rest are padding that only sees itself)

so every level of every tree is one drafter forward; a node sees its sequence's verified prefix,
the drafted nodes its tree level says (`visible`, in feeding order: `columns` maps them to batch
columns) and itself. At the end of the round each sequence's fed nodes go to its own SA cache in
feeding order, exactly what drafting it alone leaves there, so acceptance and compaction
(session.py) are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_moa.kinds.moa.model import MoADrafter, MoADraftState
from vllm_moa.layers import KVCache
from vllm_moa.target import TargetModel, TargetOutput

# one sequence's level: tokens [n_b], positions [n_b], visible [n_b, F_b + n_b]; None: sits it out
Level = tuple[Tensor, Tensor, Tensor] | None


@dataclass
class BatchedRound:
    states: list[MoADraftState]
    verified: list[int]  # R_b
    sa: KVCache  # [B, H_kv, C + levels' columns, d]
    row_k: Tensor  # [B, H_kv, R, d]
    row_v: Tensor
    ca_mask: Tensor  # [B, 1, 1, R]: the verified rows of each sequence
    columns: list[list[int]]  # per sequence: its fed nodes' SA columns, in feeding order


def _pad(parts: list[Tensor], length: int) -> Tensor:
    """[1, H, L_b, d] each -> [B, H, length, d], zeros after each part."""
    out = parts[0].new_zeros(len(parts), parts[0].shape[1], length, parts[0].shape[3])
    for b, part in enumerate(parts):
        out[b, :, : part.shape[2]] = part[0]
    return out


def open_round(states: list[MoADraftState]) -> BatchedRound:
    """Pad the sequences' caches for a round (each SA cache holds exactly its verified tokens)."""
    verified = [state.num_verified for state in states]
    for state, rows in zip(states, verified):
        if rows == 0 or state.sa_length != rows:
            raise ValueError(f"a batched MoA round starts on verified tokens only: SA holds {state.sa_length}, "
                             f"{rows} are verified")
    longest = max(verified)
    sa = KVCache()
    sa.k, sa.v = _pad([s.sa.k for s in states], longest), _pad([s.sa.v for s in states], longest)
    row_k, row_v = _pad([s.row_k for s in states], longest), _pad([s.row_v for s in states], longest)
    device = row_k.device
    ca_mask = (torch.arange(longest, device=device)[None, :] < torch.tensor(verified, device=device)[:, None])
    return BatchedRound(states, verified, sa, row_k, row_v, ca_mask[:, None, None], [[] for _ in states])


def step(drafter: MoADrafter, batch: BatchedRound, target: TargetModel, levels: list[Level]) -> list[Tensor | None]:
    """One tree level of every sequence in one forward -> per sequence its logits [n_b, V] (None
    where it sat out)."""
    width = max(level[0].shape[0] for level in levels if level is not None)
    b, device = len(levels), batch.row_k.device
    start = batch.sa.length
    tokens = torch.zeros(b, width, dtype=torch.long, device=device)
    positions = torch.zeros(b, width, dtype=torch.long, device=device)
    sa_mask = torch.zeros(b, 1, width, start + width, dtype=torch.bool, device=device)
    own = torch.arange(width, device=device)
    sa_mask[:, 0, own, start + own] = True  # every row (padding too) sees itself
    for row, level in enumerate(levels):
        if level is None:
            continue
        level_tokens, level_positions, visible = level
        n, fed = level_tokens.shape[0], len(batch.columns[row])
        tokens[row, :n], positions[row, :n] = level_tokens, level_positions
        positions[row, n:] = level_positions[0]
        sa_mask[row, 0, :n, : batch.verified[row]] = True
        if fed:
            sa_mask[row, 0, :n, batch.columns[row]] = visible[:, :fed]
    feature = drafter.features(target.embed(tokens), positions, sa_mask, batch.sa, batch.row_k, batch.row_v,
                               batch.ca_mask)  # [B, n, E]
    logits = drafter.draft_logits(feature, target)  # [B, n, V]
    out: list[Tensor | None] = []
    for row, level in enumerate(levels):
        if level is None:
            out.append(None)
            continue
        n = level[0].shape[0]
        batch.columns[row].extend(range(start, start + n))
        out.append(logits[row, :n])
    return out


def close_round(batch: BatchedRound) -> None:
    """Each sequence's fed nodes, in feeding order, into its own SA cache."""
    for row, (state, columns) in enumerate(zip(batch.states, batch.columns)):
        if columns:
            index = torch.tensor(columns, device=batch.sa.k.device)
            state.sa.append(batch.sa.k[row : row + 1].index_select(2, index),
                            batch.sa.v[row : row + 1].index_select(2, index))


def rows_for_many(drafter: MoADrafter, verified: list[TargetOutput]) -> list[Tensor]:
    """CA rows [1, n_b, E] of each sequence's accepted tokens, by one LSA call over all of them
    (LSA is per token: tokens never mix)."""
    lengths = [out.keys[0].shape[2] for out in verified]
    keys = [torch.cat(per_layer, dim=2) for per_layer in zip(*(out.keys for out in verified))]
    values = [torch.cat(per_layer, dim=2) for per_layer in zip(*(out.values for out in verified))]
    final = torch.cat([out.hidden_states[-1] for out in verified], dim=1) if drafter.lsa.reads_final_hidden else None
    rows = drafter.rows_from_kv(keys, values, final)  # [1, sum n_b, E]
    return list(rows.split(lengths, dim=1))


def row_kv_for_many(drafter: MoADrafter, states: list[MoADraftState],
                    rows: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """CA keys/values [1, H_kv, n_b, d] of each sequence's new rows [1, n_b, E] (at the positions
    after its verified tokens), by one call over all of them."""
    device = rows[0].device
    positions = torch.cat([torch.arange(s.num_verified, s.num_verified + r.shape[1], device=device)
                           for s, r in zip(states, rows)])[None]
    k, v = drafter.ca.row_keys_values(torch.cat(rows, dim=1), positions)
    lengths = [r.shape[1] for r in rows]
    return list(zip(k.split(lengths, dim=2), v.split(lengths, dim=2)))


def feed_many(drafter: MoADrafter, states: list[MoADraftState], tokens: list[Tensor], target: TargetModel) -> None:
    """MoADrafter.feed for many sequences, tokens[b] [m_b] after each one's SA cache, in one call
    (a token's SA cache entry depends only on the token and its position)."""
    device = tokens[0].device
    positions = torch.cat([torch.arange(s.sa_length, s.sa_length + t.shape[0], device=device)
                           for s, t in zip(states, tokens)])[None]
    k, v = drafter.sa.keys_values(target.embed(torch.cat(tokens)[None]), positions)  # [1, H_kv, sum m_b, d]
    lengths = [t.shape[0] for t in tokens]
    for state, k_b, v_b in zip(states, k.split(lengths, dim=2), v.split(lengths, dim=2)):
        state.sa.append(k_b, v_b)
