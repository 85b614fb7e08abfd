"""A tiny-vocabulary target (4 tokens) whose exact distribution of short continuations
transformers can enumerate, and Pearson's chi-square against it: the lossless-sampling tests of
draft trees and lookup drafts inside vLLM's engine (a plain module, imported by the tests)."""

from __future__ import annotations

import itertools
from collections import Counter
from functools import cache

import torch

VOCAB, NEW_TOKENS, SAMPLES, TEMPERATURE = 4, 3, 4000, 0.8
PROMPT = [1, 3, 0, 2]


@cache
def tiny_models(root: str) -> tuple[str, str]:
    """A random 2-layer Llama over 4 tokens (its LM head scaled up so that the next-token
    distributions are far from uniform: top token 0.45-0.57 at T = 0.8) and an untrained MoA
    drafter for it (its top-3 of 4 tokens hold the target's token often, at any depth)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_moa.kinds.moa import MoAConfig, MoADrafter
    from vllm_moa.target import TargetModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=VOCAB - 1, pad_token_id=0)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(5.0)
    target.save_pretrained(f"{root}/target")
    signature = TargetModel.from_pretrained(f"{root}/target").signature
    torch.manual_seed(1)
    MoADrafter(MoAConfig(target=signature, tli=0, lsa_num_heads=2, sa_num_heads=2, sa_num_kv_heads=1, sa_head_dim=32,
                         ca_num_heads=2, ca_num_kv_heads=1, ca_head_dim=32)).save_pretrained(f"{root}/drafter")
    return f"{root}/target", f"{root}/drafter"


def exact_distribution(target_dir: str, temperature: float, prompt: tuple[int, ...] = tuple(PROMPT)
                       ) -> dict[tuple[int, ...], float]:
    """P(first NEW_TOKENS tokens after `prompt`) under token-by-token sampling from the target
    (transformers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    probs = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
            logits = model(torch.tensor([list(prompt) + list(seq[:-1])])).logits[0, len(prompt) - 1:]
            p = torch.softmax(logits / temperature, dim=-1)
            probs[seq] = float(torch.prod(p[torch.arange(NEW_TOKENS), torch.tensor(seq)]))
    return probs


def chi_square_p(counts: Counter, probs: dict) -> float:
    """Pearson's chi-square test of counts against probs; the p-value (torch's regularized gamma)."""
    assert sum(counts[s] for s in probs if probs[s] == 0) == 0, "sampled an impossible sequence"
    total = sum(counts.values())
    cells = [(counts[s], probs[s] * total) for s in probs if probs[s] > 0]
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))
