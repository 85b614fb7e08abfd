"""An independent small LM: its own embedding, layers and KV caches; reads nothing from the target.

    config.py    IndependentDrafterConfig (config.json)
    model.py     IndependentDrafter
    session.py   IndependentSession: drafting in the runtime
    client.py    LocalIndependent: drafting on a client (nothing to sync)

and the one registration below."""

from __future__ import annotations

from vllm_moa.kinds.independent.client import LocalIndependent
from vllm_moa.kinds.independent.config import IndependentDrafterConfig
from vllm_moa.kinds.independent.model import IndependentDrafter
from vllm_moa.kinds.independent.session import IndependentSession
from vllm_moa.registry import DrafterKind, register

INDEPENDENT = register(DrafterKind(
    name="independent",
    summary="an independent small language model",
    drafter_class=IndependentDrafter,
    config_class=IndependentDrafterConfig,
    runtime_session=lambda drafter, target: IndependentSession(drafter),
    client_session=lambda drafter, target: LocalIndependent(drafter),
))

__all__ = ["INDEPENDENT", "IndependentDrafter", "IndependentDrafterConfig", "IndependentSession",
           "LocalIndependent"]
