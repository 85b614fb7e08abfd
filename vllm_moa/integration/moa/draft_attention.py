"""The attention metadata and slot mappings of the drafter's layers in vLLM's draft loop, where
they differ from a draft model's (MoAProposer's two overrides call these):

    CA     attends the R verified rows of its request: its own sequence lengths (tap.row_seq_lens),
           non-causal in the first pass (every query of the pass, in particular the one at the
           token the target just sampled, sees rows 0..R-1), and no KV writes (the tap writes CA's
           cache, never the forward). With the drafter's attention window W (a sliding window in
           the backend, aligned at each query's last key) the first pass is causal over R +
           num_rejected slots instead: the query at the sampled token, which the rejected drafts'
           queries follow, aligns with row R - 1 and reads rows R - W .. R - 1 (the queries after
           it read stale slots; their outputs are never used)
    TLI    the target's own last layers, run by the drafter: SA's metadata (causal, the whole
           sequence), and KV writes at drafted positions only (in the first pass at each
           request's drafting token, never over a verified token's true K/V)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vllm_moa.integration.moa.tap import PAD_SLOT, row_seq_lens
from vllm_moa.integration.shell import compat
from vllm_moa.integration.shell.draft_config import UnsupportedMoASetup


def ca_common_metadata(cad: Any, draft_index: int, num_rejected: Tensor | None, window: int) -> Any:
    """CA's CommonAttentionMetadata in draft step `draft_index` (see the module docstring):
    num_rejected [B] drafts of this step are not rows; window: the drafter's attention_window."""
    if window and draft_index == 0:  # causal over R + num_rejected: vLLM's R + 1 + num_rejected, less one
        windowed = lambda lens: (lens - 1).clamp(min=1)  # noqa: E731
        return cad.replace(seq_lens=windowed(cad.seq_lens), causal=True,
                           **compat.host_seq_lens_fields(cad, windowed, exact=True))
    return cad.replace(
        seq_lens=row_seq_lens(cad.seq_lens, draft_index, num_rejected),
        causal=draft_index > 0,  # first pass: every query sees all R rows
        **compat.host_seq_lens_fields(cad, lambda lens: row_seq_lens(lens, draft_index), exact=num_rejected is None),
    )


def set_ca_and_tli_metadata(per_layer: dict[str, Any], cad: Any, draft_index: int, num_rejected: Tensor | None,
                            draft_attn_groups: list[Any], ca_layer_names: set[str], tli_layer_names: list[str],
                            draft_layer_names: set[str], window: int = 0) -> None:
    """Replace, in vLLM's per-layer metadata of draft step `draft_index`, CA's (rows of verified
    tokens: num_rejected [B] drafts of this step are not rows; window: the drafter's
    attention_window) and the TLI layers' (SA's)."""
    rows_cad = ca_common_metadata(cad, draft_index, num_rejected, window)
    for group in draft_attn_groups:
        names = ca_layer_names.intersection(group.layer_names)
        if not names:
            continue
        metadata = compat.build_drafting_metadata(group, rows_cad, draft_index)
        if draft_index == 0 and not window and getattr(metadata, "causal", False) is not False:
            raise UnsupportedMoASetup(
                f"MoA's cross-attention needs a non-causal-capable attention backend; the drafter "
                f"runs on {group.backend.get_name()} (use FLASH_ATTN, TRITON_ATTN, FLASHINFER or CPU_ATTN)"
            )
        for name in names:
            per_layer[name] = metadata
    if tli_layer_names:  # the target's TLI layers attend like SA: causal, the full sequence
        sa_metadata = next(per_layer[name] for name in draft_layer_names if name not in ca_layer_names)
        for name in tli_layer_names:
            per_layer[name] = sa_metadata


def drafter_slot_mapping(mapping: dict[str, Tensor], ca_layer_names: set[str], tli_layer_names: list[str], *,
                         first_pass: bool, sample_indices: Tensor | None) -> dict[str, Tensor]:
    """vLLM's slot mapping of the draft layers [num_tokens] each -> CA's removed (written by the tap
    only), the TLI layers' added: SA's slots, in the first pass only at sample_indices [B]."""
    for name in ca_layer_names:
        mapping.pop(name, None)
    if tli_layer_names:
        draft_slots = next(iter(mapping.values()))  # [num_tokens], SA's
        if first_pass and sample_indices is not None:
            only = torch.full_like(draft_slots, PAD_SLOT)
            only[sample_indices] = draft_slots[sample_indices]
            draft_slots = only
        for name in tli_layer_names:
            mapping[name] = draft_slots
    return mapping
