"""Tensors on the wire: what the server sends the client's drafter after each verification.

Two encodings of a float tensor whose last axis is a "row" (an Ekv2E row, a hidden state, one head's
K or V of one token):

    fp16   the values as IEEE half, little-endian                      2 bytes / value
    int8   per-row absmax quantisation: q = round(x / s), s = max|x| / 127 (s stored as fp16)
                                                                       1 byte / value + 2 / row

Bytes are base64 in JSON (33% overhead, measured in benchmarks/client_server.py); a row never
needs more precision than fp16 for drafting (the target re-checks every token).
"""

from __future__ import annotations

import base64
import binascii
import math

import numpy as np
import torch
from torch import Tensor

from vllm_moa.serving.protocol import EncodedTensor

ENCODINGS = ("fp16", "int8")


class PayloadError(ValueError):
    """A payload tensor does not decode (bad base64, wrong size, non-finite values)."""


def encode(x: Tensor, encoding: str = "fp16") -> EncodedTensor:
    """x [..., W] (any float dtype) -> EncodedTensor."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    x = x.detach().to("cpu", torch.float32).contiguous()
    shape = list(x.shape)
    if encoding == "fp16":
        data = x.to(torch.float16).numpy().astype("<f2").tobytes()
        return EncodedTensor(encoding="fp16", shape=shape, data=_b64(data))
    rows = x.reshape(-1, shape[-1]) if x.numel() else x.reshape(0, max(1, shape[-1] if shape else 1))
    scale = rows.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0  # [R, 1]
    scale = scale.to(torch.float16).to(torch.float32)  # quantise with the scale the client will see
    q = torch.round(rows / scale).clamp(-127, 127).to(torch.int8)
    return EncodedTensor(encoding="int8", shape=shape, data=_b64(q.numpy().tobytes()),
                         scale=_b64(scale.to(torch.float16).numpy().astype("<f2").tobytes()))


def decode(t: EncodedTensor, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Tensor:
    """EncodedTensor -> tensor of `t.shape`; raises PayloadError on anything inconsistent."""
    numel = math.prod(t.shape)
    raw = _unb64(t.data)
    if t.encoding == "fp16":
        if len(raw) != 2 * numel:
            raise PayloadError(f"fp16 tensor of shape {t.shape} needs {2 * numel} bytes, got {len(raw)}")
        values = torch.from_numpy(np.frombuffer(raw, dtype="<f2").astype(np.float32))
    elif t.encoding == "int8":
        width = t.shape[-1] if t.shape else 1
        rows = numel // width if width else 0
        if t.scale is None:
            raise PayloadError("int8 tensor without scales")
        scale_raw = _unb64(t.scale)
        if len(raw) != numel or len(scale_raw) != 2 * rows:
            raise PayloadError(f"int8 tensor of shape {t.shape} needs {numel} bytes and {rows} scales")
        q = torch.from_numpy(np.frombuffer(raw, dtype=np.int8).astype(np.float32)).view(rows, width)
        scale = torch.from_numpy(np.frombuffer(scale_raw, dtype="<f2").astype(np.float32)).view(rows, 1)
        values = (q * scale).reshape(-1)
    else:  # the schema only admits the two encodings
        raise PayloadError(f"unknown encoding {t.encoding!r}")
    if not torch.isfinite(values).all():
        raise PayloadError("payload holds non-finite values")
    return values.view(*t.shape).to(device=device, dtype=dtype)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise PayloadError(f"payload is not valid base64: {err}") from None
