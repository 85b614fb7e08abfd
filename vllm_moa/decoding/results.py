"""What a generation returns: one request's tokens and metrics (GenerationResult), and their
aggregate over requests (summarize), as the engine, the API and the benchmarks report them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class GenerationResult:
    """One request's output and metrics."""

    token_ids: list[int]
    finish_reason: str = "length"  # "length" | "eos" | "stop"
    text: str | None = None  # decoded, stop string excluded (when a tokenizer was given)
    target_forwards: int = 0  # decoding forwards (prefill excluded)
    accepted_per_forward: list[int] = field(default_factory=list)  # accepted drafts + 1, per verify
    drafted_per_forward: list[int] = field(default_factory=list)  # draft depth offered, per verify
    seconds: float = 0.0  # request start -> its last token
    ttft: float = 0.0  # request start -> its first token
    drafter_seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens gained per target forward: accepted draft tokens + 1 (the target's own)."""
        return sum(self.accepted_per_forward) / max(1, len(self.accepted_per_forward))

    def acceptance_by_position(self, num_positions: int) -> list[float]:
        """Share of verifications whose i-th draft token (depth i) was accepted, i = 1..num_positions."""
        rounds = max(1, len(self.accepted_per_forward))
        return [sum(1 for a in self.accepted_per_forward if a - 1 >= i) / rounds for i in range(1, num_positions + 1)]

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else float("nan")

    @property
    def drafter_share(self) -> float:
        return self.drafter_seconds / self.seconds if self.seconds > 0 else float("nan")


def summarize(results: Sequence[GenerationResult], wall_seconds: float, num_positions: int) -> dict:
    """Aggregate metrics over requests (one batch, or many runs): acceptance length over all
    target forwards, per-position acceptance, throughput over the wall time, drafter share."""
    forwards = sum(len(r.accepted_per_forward) for r in results)
    gained = sum(sum(r.accepted_per_forward) for r in results)
    tokens = sum(len(r.token_ids) for r in results)
    return {
        "requests": len(results),
        "tokens": tokens,
        "target_forwards": forwards,
        "acceptance_length": gained / max(1, forwards),
        "acceptance_by_position": [
            sum(1 for r in results for a in r.accepted_per_forward if a - 1 >= i) / max(1, forwards)
            for i in range(1, num_positions + 1)
        ],
        "tokens_per_s": tokens / wall_seconds if wall_seconds > 0 else float("nan"),
        "drafter_share": sum(r.drafter_seconds for r in results) / wall_seconds if wall_seconds > 0 else float("nan"),
        "mean_ttft_s": sum(r.ttft for r in results) / max(1, len(results)),
        "wall_s": wall_seconds,
    }
