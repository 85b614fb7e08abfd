"""What every drafter shares (base.py: the Drafter module, its outputs, loading by config;
masks.py: K-step-bounded training masks). Each kind's own model lives in its folder under
vllm_moa/kinds/ (MoA: vllm_moa.kinds.moa.MoADrafter)."""

from vllm_moa.models.base import Drafter, DraftOutput, TrainingBatchView, load_drafter, load_named

__all__ = ["DraftOutput", "Drafter", "TrainingBatchView", "load_drafter", "load_named"]
