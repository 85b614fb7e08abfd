"""An independent small LM: its own embedding, layers and KV caches; reads nothing from the target."""

from __future__ import annotations

from vllm_moa.config import IndependentDrafterConfig
from vllm_moa.decoding.drafters import IndependentSession
from vllm_moa.models import IndependentDrafter
from vllm_moa.registry import DrafterKind, register
from vllm_moa.serving.local import LocalIndependent

INDEPENDENT = register(DrafterKind(
    name="independent",
    summary="an independent small language model",
    drafter_class=IndependentDrafter,
    config_class=IndependentDrafterConfig,
    runtime_session=lambda drafter, target: IndependentSession(drafter),
    client_session=lambda drafter, target: LocalIndependent(drafter),
))
