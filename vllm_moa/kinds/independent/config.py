"""The independent small LM's configuration (config.json, model_type "moa_independent_drafter")."""

from __future__ import annotations

from typing import ClassVar

from vllm_moa.config import DrafterConfigBase, Option, check_divisible, check_positive, decoder_options


class IndependentDrafterConfig(DrafterConfigBase):
    """Independent small LM on the target's tokenizer (own embedding, own LM head)."""

    model_type = "moa_independent_drafter"
    SUPPORTS_DRAFT_VOCAB: ClassVar[bool] = False  # it has its own LM head: shrink that instead
    OPTIONS: ClassVar[dict[str, Option]] = {
        "hidden_size": Option(int, 64, "model width"),
        "num_layers": Option(int, 2, "decoder layers"),
        **decoder_options(heads=4, kv_heads=2, head_dim=16, intermediate=256),
    }

    def check_values(self, source: str = "config") -> None:
        check_positive(self, source, "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "intermediate_size")
        check_divisible(self, source, "num_heads", "num_kv_heads")
