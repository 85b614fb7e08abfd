"""The public text-in, text-out API over the runtime (decoding/engine.py).

    from vllm_moa import Speculator
    spec = Speculator.from_pretrained()                 # the shipped demo target + MoA drafter (+ lookup)
    print(spec.generate("def parse(", max_tokens=64)[0].text)
    for piece in spec.stream("class Queue:"):           # text as the target verifies it
        print(piece, end="")

`target` is a transformers directory (Llama / Qwen2 / Mistral); `drafter` is a drafter directory
trained by `vllm-moa train`, a shipped demo drafter name, a model-free kind ("ngram", "none") or
None (plain decoding); see vllm_moa/kinds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from vllm_moa import registry as kinds
from vllm_moa.chat import encode_prompt
from vllm_moa.decoding.engine import SpeculativeEngine
from vllm_moa.decoding.results import GenerationResult
from vllm_moa.decoding.retrieval import Retrieval, lookup_options
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.decoding.tree import DEFAULT_TREE, DraftSpec
from vllm_moa.target import TargetModel

__all__ = ["DEFAULT_TREE", "Speculator", "generate"]


class Speculator:
    def __init__(self, engine: SpeculativeEngine) -> None:
        if engine.tokenizer is None:
            raise ValueError("Speculator needs an engine with a tokenizer")
        self.engine = engine
        self.tokenizer = engine.tokenizer

    @classmethod
    def from_pretrained(cls, target: str | Path | None = None, drafter: str | Path | None = "moa-tli0",
                        spec: DraftSpec | None = None, device: str | torch.device | None = None,
                        dtype: torch.dtype = torch.float32, drafter_weights: str = "auto",
                        lookup: bool | dict | Retrieval = True) -> Speculator:
        """Load a target (default: the shipped demo target) and a drafter checked against it, its
        linears on `drafter_weights` in CPU inference (auto | fp32 | bf16 | int8: models.load_named).
        `lookup`: n-gram matches in the text so far merged into a model drafter's drafts (on by
        default; False: the drafter alone; a dict or Retrieval: its options;
        decoding.retrieval.lookup_options)."""
        from transformers import AutoTokenizer

        from vllm_moa.models import load_named as load
        from vllm_moa.packed_linear import check_drafter_weights
        from vllm_moa.shipped import SHIPPED

        check_drafter_weights(drafter_weights)  # before any model loads
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        target_dir = Path(target) if target is not None else SHIPPED / "target"
        target_model = TargetModel.from_pretrained(target_dir, dtype=dtype, device=device)
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        draft = load(drafter, target_model, drafter_weights)
        retrieval = lookup_options(lookup, model_free=kinds.kind_of(kinds.as_drafter(draft)).model_free)
        return cls(SpeculativeEngine(target_model, draft, spec or DEFAULT_TREE, tokenizer, retrieval=retrieval))

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids: text as it is, or in the target's chat template (`chat`, when it has one)."""
        if isinstance(prompt, str):
            return encode_prompt(self.tokenizer, prompt, chat)
        return list(prompt)

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]], max_tokens: int = 128,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop: Sequence[str] | None = None, ignore_eos: bool = False,
                 chat: bool = False) -> list[GenerationResult]:
        """Generate for one prompt or a batch (text or token ids; `chat`: text in the target's chat
        template); results carry `.text`."""
        batch = self._batch(prompts, chat)
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        eos = None if ignore_eos else self.tokenizer.eos_token_id
        results = self.engine.generate(batch, max_tokens, sampling, seed, eos, stop)
        for result in results:
            if result.text is None:
                result.text = self.tokenizer.decode(result.token_ids)
        return results

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               stop: Sequence[str] | None = None, ignore_eos: bool = False, chat: bool = False) -> Iterator[str]:
        """Yield the text of one request piece by piece, as the target verifies it. The pieces
        add up to the result's text (a stop string is never shown)."""
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        eos = None if ignore_eos else self.tokenizer.eos_token_id
        batch = self.engine.start([self.encode(prompt, chat)], [max_tokens], sampling, seed, eos, stop)
        shown = 0
        while True:
            running = batch.step()
            result = batch.results[0]
            text = result.text if result.text is not None else self.tokenizer.decode(result.token_ids)
            if not running:
                if len(text) > shown:
                    yield text[shown:]
                self.last_result = result
                return
            # hold back what a stop string could still claim, and a trailing partial character
            safe = len(text) - (max((len(s) for s in stop), default=0) if stop else 0)
            safe = min(safe, len(text.rstrip("\ufffd")))
            if safe > shown:
                yield text[shown:safe]
                shown = safe

    def _batch(self, prompts, chat: bool) -> list[list[int]]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            return [self.encode(prompts, chat)]
        return [self.encode(p, chat) for p in prompts]


def generate(prompts, max_tokens: int = 128, target: str | Path | None = None,
             drafter: str | Path | None = "moa-tli0", spec: DraftSpec | None = None,
             lookup: bool | dict | Retrieval = True, **kwargs) -> list[GenerationResult]:
    """One-call generation: load (default: the shipped demo models) and generate."""
    return Speculator.from_pretrained(target, drafter, spec, lookup=lookup).generate(prompts, max_tokens, **kwargs)
