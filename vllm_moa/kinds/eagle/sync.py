"""What the server sends an EAGLE-style client after verification (serving/protocol.py's SyncPayload)."""

from __future__ import annotations

from torch import Tensor

from vllm_moa.serving.payload import encode
from vllm_moa.serving.protocol import SyncPayload
from vllm_moa.target import TargetOutput


def server_sync(payload: SyncPayload, out: TargetOutput, index: Tensor, encoding: str, served: None) -> None:
    """The verified tokens' final hidden states [n, E]: the features EAGLE feeds on."""
    payload.hidden = encode(out.hidden_states[-1][0].index_select(0, index), encoding)
