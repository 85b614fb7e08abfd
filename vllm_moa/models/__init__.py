"""Drafters: MoA (the method), and the EAGLE-style and independent-LM baselines."""

from vllm_moa.models.base import Drafter, DraftOutput, TrainingBatchView, load_drafter, load_named
from vllm_moa.models.eagle import EagleDrafter
from vllm_moa.models.independent import IndependentDrafter
from vllm_moa.models.moa import MoADrafter, MoADraftState

__all__ = [
    "DraftOutput",
    "Drafter",
    "EagleDrafter",
    "IndependentDrafter",
    "MoADraftState",
    "MoADrafter",
    "TrainingBatchView",
    "load_drafter",
    "load_named",
]
