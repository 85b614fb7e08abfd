"""What the server sends a MoA client after verification (serving/protocol.py's SyncPayload)."""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_moa.kinds.moa.model import MoADrafter
from vllm_moa.serving.payload import encode
from vllm_moa.serving.protocol import SyncPayload
from vllm_moa.target import TargetOutput


def server_sync(payload: SyncPayload, out: TargetOutput, index: Tensor, encoding: str,
                served: MoADrafter | None) -> None:
    """The verified tokens' Ekv2E rows [n, E], made with the server's copy of the LSA weights
    (`served`), plus the last TLI layers' K/V [tli, H_kv, n, d]."""
    keys = [k.index_select(2, index) for k in out.keys]  # L x [1, H_kv, n, d]
    values = [v.index_select(2, index) for v in out.values]
    final = out.hidden_states[-1]  # [1, n, E] (read with final_hidden_rows; None: rows the prefix cache served)
    final = None if final is None else final.index_select(1, index)
    payload.rows = encode(served.rows_from_kv(keys, values, final)[0], encoding)  # [n, E]
    if served.tli > 0:
        first = len(keys) - served.tli
        payload.tli_keys = encode(torch.cat(keys[first:], dim=0), encoding)  # [tli, H_kv, n, d]
        payload.tli_values = encode(torch.cat(values[first:], dim=0), encoding)
