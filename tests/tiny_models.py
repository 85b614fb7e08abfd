"""Tiny random Llama / Qwen2 targets for tests (imported as `tiny_models`; tests/conftest.py puts
this folder on sys.path)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from vllm_moa.target import TargetModel

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def make_hf_target(family: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    kwargs = {**TINY, **overrides}
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**kwargs)).eval()
    raise ValueError(family)


def make_target(family: str = "llama", seed: int = 0, **overrides) -> TargetModel:
    return TargetModel(make_hf_target(family, seed, **overrides), name=f"tiny-{family}-{seed}")

