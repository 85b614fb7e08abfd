"""A prompt as the target reads it: through its chat template when its tokenizer has one (one user
turn, the assistant's turn opened), as raw text otherwise or when asked.

Every entry point that takes text from a user (`vllm-moa generate`, `vllm-moa client`, the demo,
the benchmarks, the training recipes) encodes it here, so an instruct target answers the same
prompt the same way whichever path it came through."""

from __future__ import annotations

from typing import Any


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of `prompt`: the target's chat template around it when `chat` and the tokenizer has
    one, else the raw text."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(prompt)["input_ids"])
