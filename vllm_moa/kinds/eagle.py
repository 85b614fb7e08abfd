"""The EAGLE-style baseline: one decoder layer over (token, previous feature), feature-autoregressive
past the last verified token."""

from __future__ import annotations

from torch import Tensor

from vllm_moa.config import EagleDrafterConfig
from vllm_moa.decoding.drafters import EagleSession
from vllm_moa.models import EagleDrafter
from vllm_moa.registry import DrafterKind, register
from vllm_moa.serving.local import LocalEagle
from vllm_moa.serving.payload import encode
from vllm_moa.serving.protocol import SyncPayload
from vllm_moa.target import TargetOutput


def server_sync(payload: SyncPayload, out: TargetOutput, index: Tensor, encoding: str, served: None) -> None:
    """The verified tokens' final hidden states [n, E]: the features EAGLE feeds on."""
    payload.hidden = encode(out.hidden_states[-1][0].index_select(0, index), encoding)


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
