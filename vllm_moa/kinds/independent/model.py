"""Independent small LM drafter: its own embedding, decoder stack and LM head on the target's
tokenizer, distilled from the target's logits. It sees nothing of the target's activations, so
its draft quality does not depend on the anchor: the baseline MoA and EAGLE must beat."""

from __future__ import annotations

import torch
from torch import nn

from vllm_moa.kinds.independent.config import IndependentDrafterConfig
from vllm_moa.layers import DecoderBlock, KVCache, RMSNorm, causal_mask_after
from vllm_moa.models.base import Drafter, DraftOutput, TrainingBatchView
from vllm_moa.models.masks import self_attention_mask
from vllm_moa.packed_linear import Linear
from vllm_moa.target import TargetModel, TargetOutput


class IndependentDrafter(Drafter):
    config_class = IndependentDrafterConfig

    def __init__(self, config: IndependentDrafterConfig) -> None:
        super().__init__(config)
        config.check_values()
        vocab = config.target_signature.vocab_size
        self.embed = nn.Embedding(vocab, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderBlock(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                         config.intermediate_size, config.rope_theta, config.rms_norm_eps)
            for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, caches: list[KVCache] | None = None,
                positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal LM over [B, T] after `caches` (if any) -> logits [B, T, V]. A draft tree passes its
        own positions [B, T] and mask [B, 1, T, T_past + T]."""
        b, t = input_ids.shape
        past = caches[0].length if caches else 0
        if positions is None:
            positions = torch.arange(past, past + t, device=input_ids.device).expand(b, t)
        if mask is None:
            mask = causal_mask_after(past, t, input_ids.device)
        hidden = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, positions, mask, caches[i] if caches else None)
        return self.lm_head(self.norm(hidden))

    def training_forward(self, batch: TrainingBatchView, target: TargetModel, target_out: TargetOutput) -> DraftOutput:
        del target, target_out  # independent: token ids only
        ids = batch.input_ids
        b, t = ids.shape
        positions = torch.arange(t, device=ids.device).expand(b, t)
        mask = self_attention_mask(batch.last_anchor, None)
        hidden = self.embed(ids)
        for layer in self.layers:
            hidden = layer(hidden, positions, mask)
        return DraftOutput(self.lm_head(self.norm(hidden)), [])
