"""EAGLE-style baseline drafter (Li et al., 2024): one decoder layer over
fc([token embedding; target's last hidden state]), predicting the next hidden state, which the
target's LM head turns into logits. Drafting is *feature autoregressive*: past the last verified
token the drafter consumes its own predicted features.

Training runs through the same anchors as MoA: position i reads the true feature f_{i-1} when
i-1 <= s(i) and a predicted one otherwise. `rollout_passes` unrolls that autoregression (P passes
make depths 1..P exact); P = 1 is EAGLE-1/2's teacher forcing on true features.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_moa.kinds.eagle.config import EagleDrafterConfig
from vllm_moa.layers import DecoderBlock
from vllm_moa.models.base import Drafter, DraftOutput, TrainingBatchView
from vllm_moa.models.masks import self_attention_mask
from vllm_moa.packed_linear import Linear
from vllm_moa.target import TargetModel, TargetOutput


class EagleDrafter(Drafter):
    config_class = EagleDrafterConfig

    def __init__(self, config: EagleDrafterConfig) -> None:
        super().__init__(config)
        config.check_values()
        width = config.target_signature.hidden_size
        self.fc = Linear(2 * width, width, bias=False)
        self.layer = DecoderBlock(width, config.num_heads, config.num_kv_heads, config.head_dim,
                                  config.intermediate_size, config.rope_theta, config.rms_norm_eps)
        self.rollout_passes = 1

    def _predict(self, embeds: Tensor, features_in: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
        """embeds, features_in [B, T, E] -> predicted features [B, T, E]"""
        return self.layer(self.fc(torch.cat([embeds, features_in], dim=-1)), positions, mask)

    def training_forward(self, batch: TrainingBatchView, target: TargetModel, target_out: TargetOutput,
                         rollout_passes: int | None = None) -> DraftOutput:
        ids, s = batch.input_ids, batch.last_anchor
        b, t = ids.shape
        passes = rollout_passes or self.rollout_passes
        positions = torch.arange(t, device=ids.device).expand(b, t)
        embeds = target.embed(ids)
        true_features = target_out.hidden_states[-1]  # [B, T, E] post-norm, f_i predicts x_{i+1}
        # input at position i is f_{i-1} (zeros at i = 0)
        shifted_true = torch.cat([torch.zeros_like(true_features[:, :1]), true_features[:, :-1]], dim=1)
        prev_is_verified = (positions - 1) <= s  # f_{i-1} comes from the target
        mask = self_attention_mask(s, None)
        features_in = shifted_true
        predicted = self._predict(embeds, features_in, positions, mask)
        for _ in range(passes - 1):
            shifted_pred = torch.cat([torch.zeros_like(predicted[:, :1]), predicted[:, :-1]], dim=1)
            features_in = torch.where(prev_is_verified[..., None], shifted_true, shifted_pred)
            predicted = self._predict(embeds, features_in, positions, mask)
        return DraftOutput(self.vocab_logits(predicted, target), [(predicted, true_features, 1.0)], self.draft_vocab)
