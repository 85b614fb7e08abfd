"""The EAGLE-style baseline: one decoder layer over (token, previous feature), feature-autoregressive
past the last verified token.

    config.py    EagleDrafterConfig (config.json)
    model.py     EagleDrafter
    session.py   EagleSession: drafting in the runtime
    client.py    LocalEagle: drafting on a client, fed by the server's hidden states
    sync.py      server_sync: the hidden states a server sends after verification

and the one registration below."""

from __future__ import annotations

from vllm_moa.kinds.eagle.client import LocalEagle
from vllm_moa.kinds.eagle.config import EagleDrafterConfig
from vllm_moa.kinds.eagle.model import EagleDrafter
from vllm_moa.kinds.eagle.session import EagleSession
from vllm_moa.kinds.eagle.sync import server_sync
from vllm_moa.registry import DrafterKind, register


def prepare_training(drafter: EagleDrafter, config) -> None:
    drafter.rollout_passes = config.eagle_rollout  # feature-autoregression passes (1: teacher forcing)


EAGLE = register(DrafterKind(
    name="eagle",
    summary="EAGLE-style baseline: one decoder layer over (token, target feature)",
    drafter_class=EagleDrafter,
    config_class=EagleDrafterConfig,
    runtime_session=EagleSession,
    client_session=LocalEagle,
    server_sync=server_sync,
    client_needs_target=True,
    prepare_training=prepare_training,
    # evaluated as it drafts: depth d runs on its own predicted features, d + 1 passes
    evaluation_options=lambda depth: {"rollout_passes": depth + 1},
))

__all__ = ["EAGLE", "EagleDrafter", "EagleDrafterConfig", "EagleSession", "LocalEagle", "server_sync"]
