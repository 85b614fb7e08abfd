"""n-gram lookup's drafting session in the runtime (decoding/drafters.py's DraftSession)."""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_moa.decoding.retrieval import continuations, merge_branches
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.decoding.tree import DraftSpec, DraftTree
from vllm_moa.target import TargetOutput


class NgramSession:
    """Prompt lookup: propose what followed earlier matches of the recent suffix (longest suffix
    first, most recent match first). A chain takes the first match; a tree merges the continuations
    of up to `top_k` distinct matches into a trie of at most `budget` nodes. No match: no draft."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history: list[int] = []

    starts_from_suffix = True  # lookup reads the prompt's tokens, never the target's outputs

    def start(self, prompt: Tensor, prefill: TargetOutput) -> None:
        self.history = prompt[0].tolist()

    def continuations(self, pending: int, length: int, limit: int) -> list[list[int]]:
        """Up to `limit` distinct continuations (<= `length` tokens) of history + [pending]."""
        return continuations(self.history, pending, self.max_ngram, self.min_ngram, length, limit)

    def propose(self, pending: int, spec: DraftSpec, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> DraftTree:
        """Deterministic proposals (point masses when sampling)."""
        found = self.continuations(pending, spec.depth, 1 if spec.is_chain else spec.top_k)
        return merge_branches(DraftTree.single(pending, "cpu"), found, spec.max_nodes)

    def accept(self, tree: DraftTree, path: list[int], verified: TargetOutput) -> None:
        self.history += tree.tokens[path].tolist()

    def skip_round(self) -> None:
        pass  # lookup keeps nothing per round
