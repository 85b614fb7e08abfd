"""Statistics shared by the sampling tests on SmolLM2's real vocabulary (a plain module, like
vllm_env.py): chi-square p-values, top-token buckets with an "other" bucket, SmolLM2's own
next-token logits and the mean negative log-likelihood of generated tokens under the target."""

from __future__ import annotations

import copy
import hashlib
from collections import Counter
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch

REPO = Path(__file__).resolve().parents[1]


def code_seed(*paths: str) -> int:
    """A seed drawn from the bytes of the code under test (files or folders of *.py under the
    repository root): a sampling test whose seeds start there draws afresh whenever that code
    changes, so an unlucky draw is not the same failure (or the same near miss) run after run, and
    a run is still reproducible from its commit."""
    digest = hashlib.sha256()
    for name in paths:
        path = REPO / name
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(file.relative_to(REPO).as_posix().encode())
            digest.update(file.read_bytes())
    return int.from_bytes(digest.digest()[:4], "big") % (1 << 30)


def chi_square_p(observed: Sequence[float], expected: Sequence[float]) -> float:
    """Pearson's goodness-of-fit test of counts against expected counts (same total); the p-value."""
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    if any(o > 0 and e == 0 for o, e in zip(observed, expected)):
        return 0.0  # an impossible outcome was observed
    return _gamma_q(len(observed) - 1, statistic)


def two_sample_p(a: Counter, b: Counter, min_count: int = 10) -> float:
    """Chi-square test of homogeneity of two samples of outcomes (outcomes seen fewer than
    `min_count` times in both together are pooled into one bucket); the p-value."""
    total = a + b
    kept = [k for k, n in total.most_common() if n >= min_count]
    rows = [[a[k] for k in kept], [b[k] for k in kept]]
    rows[0].append(sum(a.values()) - sum(rows[0]))
    rows[1].append(sum(b.values()) - sum(rows[1]))
    columns = [c for c in range(len(rows[0])) if rows[0][c] + rows[1][c] > 0]
    n_a, n_b = sum(rows[0]), sum(rows[1])
    statistic = 0.0
    for c in columns:
        col = rows[0][c] + rows[1][c]
        for row, n in ((rows[0], n_a), (rows[1], n_b)):
            e = col * n / (n_a + n_b)
            statistic += (row[c] - e) ** 2 / e
    return _gamma_q(len(columns) - 1, statistic)


def _gamma_q(dof: int, statistic: float) -> float:
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def top_buckets(tokens: Sequence[int], probs: torch.Tensor, buckets_of: torch.Tensor | None = None,
                min_expected: float = 10.0, max_buckets: int = 40) -> tuple[list[int], list[float]]:
    """(observed, expected) counts over the most likely tokens of `buckets_of` (default `probs`)
    whose expected count under `probs` is at least `min_expected`, plus one bucket for every other
    token."""
    n = len(tokens)
    ranking = torch.argsort(buckets_of if buckets_of is not None else probs, descending=True)[:max_buckets].tolist()
    kept = [t for t in ranking if float(probs[t]) * n >= min_expected]
    counts = Counter(tokens)
    observed = [counts[t] for t in kept]
    expected = [float(probs[t]) * n for t in kept]
    observed.append(n - sum(observed))
    expected.append(max(0.0, n - sum(expected)))
    return observed, expected


@cache
def smollm2():
    """(folder, transformers model, tokenizer) of SmolLM2-135M-Instruct (vllm-moa fetch smollm2)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_moa.targets import fetch_smollm2

    folder = fetch_smollm2()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return str(folder), model, AutoTokenizer.from_pretrained(str(folder))


def chat_prompt(text: str) -> list[int]:
    _, _, tokenizer = smollm2()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@torch.no_grad()
def smollm2_next_token_logits(text: str) -> torch.Tensor:
    _, model, _ = smollm2()
    return model(torch.tensor([chat_prompt(text)])).logits[0, -1].float()


class NllExcess(NamedTuple):
    """Generated tokens' NLL under the target against what sampling from the target itself gives."""
    nll: float  # mean NLL per token of the samples, at the sampling temperature
    entropy: float  # mean entropy of the target's distribution at the same positions
    z: float  # (sum of NLL - entropy) / its exact standard deviation under lossless sampling


@torch.no_grad()
def nll_excess(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], temperature: float,
               batch: int = 64) -> NllExcess:
    """The mean-NLL sentinel without a sampled baseline: for a token drawn from the target's own
    distribution p given its prefix, E[-log p(token)] is p's entropy H and its variance p's
    varentropy, so sum(NLL - H) over all generated tokens is a sum of zero-mean terms whose
    variance is known exactly; z is it over its standard deviation (|z| of a few under lossless
    sampling, tens for a sampler that is off: a wrong temperature, a biased acceptance). Each
    prompt's KV is computed once, and each distinct output of a prompt scored once, weighted by
    its count."""
    _, model, _ = smollm2()
    counts: Counter = Counter((tuple(p), tuple(o)) for p, o in zip(prompts, outputs) if o)
    by_prompt: dict[tuple[int, ...], dict[int, list[tuple[tuple[int, ...], int]]]] = {}
    for (prompt, output), n in counts.items():
        by_prompt.setdefault(prompt, {}).setdefault(len(output), []).append((output, n))
    nll_sum, entropy_sum, variance, count = 0.0, 0.0, 0.0, 0
    for prompt, by_length in by_prompt.items():
        done = model(torch.tensor([list(prompt)]), use_cache=True)
        for o_len, scored in by_length.items():
            for start in range(0, len(scored), batch):
                chunk = scored[start:start + batch]
                ids = torch.tensor([o for o, _ in chunk])  # [B, o_len]
                weights = torch.tensor([n for _, n in chunk], dtype=torch.float64)  # [B]
                logits = done.logits[0, -1:].expand(len(chunk), 1, -1)  # [B, 1, V]: the first token's
                if o_len > 1:
                    cache = copy.deepcopy(done.past_key_values)
                    cache.batch_repeat_interleave(len(chunk))
                    later = model(ids[:, :-1], past_key_values=cache, use_cache=True).logits  # [B, o_len - 1, V]
                    logits = torch.cat([logits, later], dim=1)
                logp = torch.log_softmax(logits.double() / temperature, dim=-1)  # [B, o_len, V]
                p = logp.exp()
                entropy = -(p * logp).sum(-1)  # [B, o_len]
                varentropy = (p * logp.square()).sum(-1) - entropy.square()  # [B, o_len]
                nll = -logp.gather(-1, ids[..., None])[..., 0]  # [B, o_len]
                nll_sum += float((nll.sum(-1) * weights).sum())
                entropy_sum += float((entropy.sum(-1) * weights).sum())
                variance += float((varentropy.sum(-1) * weights).sum())
                count += int(weights.sum()) * o_len
    count = max(1, count)
    return NllExcess(nll_sum / count, entropy_sum / count, (nll_sum - entropy_sum) / max(variance, 1e-12) ** 0.5)


def pair_distribution(prompt: Sequence[int], temperature: float, warp=None,
                      first_tokens: int = 48) -> dict[tuple[int, int], float]:
    """P(first two generated tokens) under SmolLM2's own sampling at `temperature` (`warp`: a
    function of tempered logits [N, V] applying top-k / top-p, or None), for the `first_tokens`
    likeliest first tokens. Without `warp`, computed once per prompt and temperature (read-only)."""
    if warp is None:
        return _unwarped_pair_distribution(tuple(prompt), temperature, first_tokens)
    return _pair_distribution(prompt, temperature, warp, first_tokens)


@cache
def _unwarped_pair_distribution(prompt: tuple[int, ...], temperature: float,
                                first_tokens: int) -> dict[tuple[int, int], float]:
    return _pair_distribution(prompt, temperature, None, first_tokens)


@torch.no_grad()
def _pair_distribution(prompt: Sequence[int], temperature: float, warp,
                       first_tokens: int) -> dict[tuple[int, int], float]:
    _, model, _ = smollm2()

    def probs(logits: torch.Tensor) -> torch.Tensor:
        scaled = logits.float() / temperature
        return torch.softmax(warp(scaled) if warp is not None else scaled, dim=-1)

    first = probs(model(torch.tensor([list(prompt)])).logits[:, -1])[0]
    heads = torch.argsort(first, descending=True)[:first_tokens]
    second = probs(model(torch.tensor([list(prompt) + [int(t)] for t in heads])).logits[:, -1])
    return {(int(t), int(s)): float(first[t] * second[row, s])
            for row, t in enumerate(heads) for s in torch.nonzero(second[row] > 1e-6).flatten().tolist()}


def pair_p(outputs: Sequence[Sequence[int]], probs: dict[tuple[int, int], float], buckets_of=None,
           min_expected: float = 10.0) -> float:
    """Chi-square p-value of the first-two-token pairs of `outputs` against `probs`: the pairs with
    an expected count of at least `min_expected` (in the order of `buckets_of`, default `probs`),
    plus one "other" bucket."""
    n = len(outputs)
    counts = Counter(tuple(o[:2]) for o in outputs)
    ranking = buckets_of or probs
    kept = [pair for pair in sorted(ranking, key=ranking.get, reverse=True) if probs.get(pair, 0.0) * n >= min_expected]
    assert len(kept) >= 6, f"too few likely pairs ({len(kept)}) for a test with power"
    observed = [counts[pair] for pair in kept] + [n - sum(counts[pair] for pair in kept)]
    expected = [probs[pair] * n for pair in kept]
    expected.append(max(0.0, n - sum(expected)))
    return chi_square_p(observed, expected)
