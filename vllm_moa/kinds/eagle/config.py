"""The EAGLE-style drafter's configuration (config.json, model_type "moa_eagle_drafter")."""

from __future__ import annotations

from typing import ClassVar

from vllm_moa.config import DrafterConfigBase, Option, check_divisible, check_positive, decoder_options


class EagleDrafterConfig(DrafterConfigBase):
    """EAGLE-style baseline: one decoder layer over fc([token embedding; target last hidden])."""

    model_type = "moa_eagle_drafter"
    OPTIONS: ClassVar[dict[str, Option]] = decoder_options(heads=4, kv_heads=2, head_dim=16, intermediate=256)

    def check_values(self, source: str = "config") -> None:
        check_positive(self, source, "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
        check_divisible(self, source, "num_heads", "num_kv_heads")
