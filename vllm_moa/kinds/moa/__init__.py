"""The MoA drafter (the method; docs/method.md): Layer Self-Attention over the target's per-layer
K/V, cross- and self-attention, optionally the target's last TLI layers.

    config.py    MoAConfig (config.json)
    model.py     MoADrafter (training and incremental drafting), MoADraftState
    session.py   MoASession: drafting in the runtime
    batched.py   a batch's sequences drafted in one forward per tree level (the runtime, TLI = 0)
    client.py    LocalMoA: drafting on a client, fed by the server's rows
    sync.py      server_sync: the rows (+ TLI K/V) a server sends after verification

and the one registration below. The vLLM method "moa" (vllm_moa/integration/) builds on the config
and the model."""

from __future__ import annotations

from vllm_moa.kinds.moa.client import LocalMoA
from vllm_moa.kinds.moa.config import MoAConfig
from vllm_moa.kinds.moa.model import MoADrafter, MoADraftState
from vllm_moa.kinds.moa.session import MoASession
from vllm_moa.kinds.moa.sync import server_sync
from vllm_moa.registry import DrafterKind, register

MOA = register(DrafterKind(
    name="moa",
    display_name="MoA",
    summary="Mixture of Attentions: LSA over the target's layers, cross- and self-attention",
    drafter_class=MoADrafter,
    config_class=MoAConfig,
    runtime_session=MoASession,
    client_session=LocalMoA,
    server_sync=server_sync,
    sync_reads_hidden=lambda drafter: drafter.lsa.reads_final_hidden,
    client_needs_target=True,
    declares_lsa=True,
    training_options=lambda config: {"tli": config.tli},
))

__all__ = ["MOA", "LocalMoA", "MoAConfig", "MoADraftState", "MoADrafter", "MoASession", "server_sync"]
