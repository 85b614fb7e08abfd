"""Helpers for the client-server tests: tiny drafters of every kind and a real uvicorn server on
127.0.0.1 in a background thread."""

from __future__ import annotations

import contextlib

import torch

from vllm_moa.config import EagleDrafterConfig, IndependentDrafterConfig, MoAConfig
from vllm_moa.models import EagleDrafter, IndependentDrafter, MoADrafter
from vllm_moa.serving.backend import TransformersBackend
from vllm_moa.serving.protocol import ServerLimits
from vllm_moa.serving.server import ServerThread, create_app

DRAFTER_KINDS = ("moa-tli0", "moa-tli1", "eagle", "independent", "ngram")


def tiny_drafters(target, seed: int = 0) -> dict:
    """Random (untrained) drafters of every kind for `target`: their drafts are mostly rejected,
    which exercises rollbacks hard."""
    torch.manual_seed(seed)
    return {
        "moa-tli0": MoADrafter(MoAConfig(target=target.signature, tli=0)).eval(),
        "moa-tli1": MoADrafter(MoAConfig(target=target.signature, tli=1)).eval(),
        "eagle": EagleDrafter(EagleDrafterConfig(target=target.signature)).eval(),
        "independent": IndependentDrafter(IndependentDrafterConfig(target=target.signature)).eval(),
        "ngram": "ngram",
    }


@contextlib.contextmanager
def running_server(target, drafters: dict, limits: ServerLimits | None = None, tokens: list[str] | None = None,
                   **app_kwargs):
    """Yields (url, app, backend) of a real server on 127.0.0.1 (a free port)."""
    backend = TransformersBackend(target, {k: v for k, v in drafters.items() if not isinstance(v, str)})
    app = create_app(backend, limits, tokens, **app_kwargs)
    server = ServerThread(app)
    url = server.start()
    try:
        yield url, app, backend
    finally:
        server.stop()
