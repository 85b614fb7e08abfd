"""Tiny random Llama / Qwen2 / Mistral targets for tests, and oracle drafting sessions (imported as
`tiny_models`; tests/conftest.py puts this folder on sys.path)."""

from __future__ import annotations

import random

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from vllm_moa.kinds.eagle import EagleSession
from vllm_moa.kinds.independent import IndependentSession
from vllm_moa.kinds.moa import MoASession
from vllm_moa.target import TargetModel

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),  # full attention, as supported
}


def make_hf_target(family: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    if family not in FAMILIES:
        raise ValueError(family)
    config_cls, model_cls, defaults = FAMILIES[family]
    torch.manual_seed(seed)
    return model_cls(config_cls(**{**TINY, **defaults, **overrides})).eval()


def make_target(family: str = "llama", seed: int = 0, **overrides) -> TargetModel:
    return TargetModel(make_hf_target(family, seed, **overrides), name=f"tiny-{family}-{seed}")


# -- oracle drafters: real sessions whose logits are nudged so that the target's greedy token sits
# at a random rank among the top 3; this makes trees accept deep paths through any branch --------
def _oracle(session_cls):
    class Oracle(session_cls):
        def __init__(self, *args, truth, seed):
            super().__init__(*args)
            self.truth, self.rng = truth, random.Random(seed)

        def _begin(self):
            super()._begin()
            self.on_truth = {}

        def _step(self, tokens, depths, parent_slots, visible):
            return self._nudge(super()._step(tokens, depths, parent_slots, visible), tokens, depths, parent_slots,
                               visible)

        @classmethod
        def _step_batch(cls, batch, sessions, levels):  # sessions that draft together (MoA TLI=0)
            logits = super()._step_batch(batch, sessions, levels)
            return [None if level is None else s._nudge(out, *level) for s, level, out in zip(sessions, levels, logits)]

        def _nudge(self, logits, tokens, depths, parent_slots, visible):
            logits = logits.clone()
            fed = visible.shape[1] - tokens.shape[0]
            for r, (token, depth, parent) in enumerate(zip(tokens.tolist(), depths, parent_slots)):
                position = self.base + depth
                on = (parent < 0 or self.on_truth[parent]) and position < len(self.truth) and self.truth[position] == token
                self.on_truth[fed + r] = on
                if on and position + 1 < len(self.truth):
                    top = logits[r].topk(3).values
                    rank = self.rng.randrange(3)
                    value = top[0] + 1 if rank == 0 else (top[rank - 1] + top[rank]) / 2
                    logits[r, self.truth[position + 1]] = value
            return logits

    return Oracle


def oracle_sessions(kind, drafter, target, prompts, greedy):
    """One oracle session per prompt (MoA, EAGLE or independent drafter): `greedy[i]` is the
    target's greedy continuation of `prompts[i]`, which the oracle steers its trees towards."""
    cls = {"moa": MoASession, "eagle": EagleSession, "independent": IndependentSession}[kind.split("-")[0]]
    oracle = _oracle(cls)
    args = (drafter,) if kind == "independent" else (drafter, target)
    return [oracle(*args, truth=p + g, seed=i) for i, (p, g) in enumerate(zip(prompts, greedy))]
