"""Drafters: MoA (the method), and the EAGLE-style and independent-LM baselines."""

from vllm_moa.models.base import DraftOutput, Drafter, TrainingBatchView, load_drafter
from vllm_moa.models.eagle import EagleDrafter
from vllm_moa.models.independent import IndependentDrafter
from vllm_moa.models.moa import MoADrafter, MoADraftState

DRAFTER_CLASSES: dict[str, type[Drafter]] = {
    cls.config_class.model_type: cls for cls in (MoADrafter, EagleDrafter, IndependentDrafter)
}

__all__ = [
    "DRAFTER_CLASSES",
    "DraftOutput",
    "Drafter",
    "EagleDrafter",
    "IndependentDrafter",
    "MoADraftState",
    "MoADrafter",
    "TrainingBatchView",
    "load_drafter",
]
