"""vllm_serve_load.py's requests: the prompt pool, the hostile and the odd-but-valid parameters,
and the seeded schedule of what each of the N requests is.

A request is a `Job`: which endpoint, the JSON body (or raw bytes), what the client does (read the
whole answer, stream it, hang up mid-stream, give up before the answer) and what it expects (2xx,
or a 4xx refusal). Greedy jobs are keyed by (endpoint, prompt, max_tokens) so their text can be
checked against no speculation at concurrency 1.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

GREEDY_MAX_TOKENS = (8, 16, 32, 64)  # mixed lengths; greedy references exist for each
SAMPLED_MAX_TOKENS = (16, 48)


@dataclass
class Job:
    index: int
    kind: str  # greedy | greedy-stream | sampled | odd | bad | stream-disconnect | abort
    case: str  # which prompt / parameter case, for the results file
    endpoint: str  # "completions" | "chat/completions"
    body: dict[str, Any] | None = None
    raw: bytes | None = None  # sent as is (malformed JSON)
    stream: bool = False
    expect: str = "2xx"  # "2xx" | "4xx"
    greedy_key: tuple | None = None  # (endpoint, prompt index, max_tokens): its text must equal the reference
    hang_up_after: int = 0  # stream-disconnect: chunks read before closing the connection
    give_up_after_s: float = 0.0  # abort: the client's read timeout
    route: str = field(init=False)

    def __post_init__(self) -> None:
        self.route = f"{self.endpoint}{' (stream)' if self.stream else ''}"
        if self.stream and self.body is not None:
            self.body = {**self.body, "stream": True}


def prompt_pool(texts: list[str]) -> list[dict]:
    """Mixed lengths: each held-out prompt alone, and a few long ones made of several."""
    pool = [{"text": t} for t in texts]
    for i in range(0, len(texts) - 3, 4):
        pool.append({"text": "\n\n".join(texts[i:i + 4]) + "\n\nAnswer the last question only."})
    return pool


def greedy_body(model: str, endpoint: str, prompt: str, max_tokens: int, **extra: Any) -> dict:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    if endpoint == "completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    return body


def bad_cases(model: str) -> list[tuple[str, str, dict | bytes]]:
    """(name, endpoint, body or raw bytes): each must be refused with a 4xx, never a 5xx."""
    base = {"model": model, "prompt": "Hello", "max_tokens": 8}
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    return [
        ("temperature -1", "completions", {**base, "temperature": -1}),
        ("temperature NaN", "completions", json.dumps({**base, "temperature": float("nan")}).encode()),
        ("temperature Infinity", "completions", json.dumps({**base, "temperature": float("inf")}).encode()),
        ("top_p 0", "completions", {**base, "top_p": 0}),
        ("top_p 1.5", "completions", {**base, "top_p": 1.5}),
        ("top_k -5", "completions", {**base, "top_k": -5}),
        ("max_tokens 1e9", "completions", {**base, "max_tokens": 10**9}),
        ("max_tokens -3", "completions", {**base, "max_tokens": -3}),
        ("n 0", "completions", {**base, "n": 0}),
        ("logprobs 1000", "completions", {**base, "logprobs": 1000}),
        ("presence_penalty 9", "completions", {**base, "presence_penalty": 9}),
        ("repetition_penalty 0", "completions", {**base, "repetition_penalty": 0}),
        ("min_tokens > max_tokens", "completions", {**base, "min_tokens": 20}),
        ("seed 'abc'", "completions", {**base, "seed": "abc"}),
        ("stop is a number", "completions", {**base, "stop": 7}),
        ("50 stop strings (at most 4)", "completions", {**base, "stop": [f"stop{i}" for i in range(50)]}),
        ("logit_bias bad key", "completions", {**base, "logit_bias": {"abc": 1}}),
        ("token id out of vocabulary", "completions", {**base, "prompt": [10**7, 5]}),
        ("prompt longer than the context", "completions", {**base, "prompt": "word " * 5000}),
        ("no prompt", "completions", {"model": model, "max_tokens": 8}),
        ("unknown model", "completions", {**base, "model": "no-such-model"}),
        ("malformed JSON", "completions", b'{"model": "x", "prompt": "Hel'),
        ("body is a list", "completions", b"[1, 2, 3]"),
        ("messages not a list", "chat/completions", {**chat, "messages": "hello"}),
        ("chat top_logprobs 99", "chat/completions", {**chat, "logprobs": True, "top_logprobs": 99}),
        ("chat n 0", "chat/completions", {**chat, "n": 0}),
    ]


def odd_cases(model: str, prompt: str) -> list[tuple[str, str, dict, tuple | None]]:
    """(name, endpoint, body, greedy max_tokens or None): valid but unusual; each must be answered
    (2xx). Greedy ones (max_tokens given) must also equal the reference."""
    base = {"model": model, "prompt": prompt}
    chat = {"model": model, "messages": [{"role": "user", "content": prompt}]}
    return [
        # vLLM raises temperatures in (0, 0.01) to 0.01: sampled, not greedy
        ("temperature 1e-40", "completions", {**base, "temperature": 1e-40, "max_tokens": 16}, None),
        ("greedy + logprobs 5", "completions", {**base, "temperature": 0, "logprobs": 5, "max_tokens": 16}, 16),
        ("chat greedy + top_logprobs 5", "chat/completions",
         {**chat, "temperature": 0, "logprobs": True, "top_logprobs": 5, "max_tokens": 16}, 16),
        ("n 3 sampled, seed", "completions", {**base, "temperature": 0.8, "n": 3, "seed": 7, "max_tokens": 16}, None),
        ("best_of-free n 2 chat", "chat/completions", {**chat, "temperature": 1.0, "n": 2, "max_tokens": 16}, None),
        ("odd stop list", "completions",
         {**base, "temperature": 0.7, "max_tokens": 32, "stop": ["\n\n", "zz" * 40, "é", "}"]}, None),
        ("stop_token_ids + ignore_eos", "completions",
         {**base, "temperature": 0.5, "max_tokens": 32, "ignore_eos": True, "stop_token_ids": [13, 198]}, None),
        ("top_k 1 top_p 0.01", "completions", {**base, "temperature": 1.3, "top_k": 1, "top_p": 0.01,
                                               "max_tokens": 24}, None),
        ("max_tokens 1", "completions", {**base, "temperature": 0, "max_tokens": 1}, None),
        ("penalties", "chat/completions", {**chat, "temperature": 0.9, "presence_penalty": 1.5,
                                           "frequency_penalty": 1.0, "repetition_penalty": 1.2, "max_tokens": 24}, None),
        ("stream + include_usage", "completions", {**base, "temperature": 0.6, "max_tokens": 24, "stream": True,
                                                   "stream_options": {"include_usage": True}}, None),
    ]


SHARES = {"greedy": 0.36, "greedy-stream": 0.14, "sampled": 0.14, "odd": 0.12, "bad": 0.12,
          "stream-disconnect": 0.08, "abort": 0.04}


def schedule(model: str, pool: list[dict], n: int, seed: int) -> list[Job]:
    """N jobs in a seeded random order, the kinds in SHARES' proportions."""
    rng = random.Random(seed)
    kinds = [k for k, share in SHARES.items() for _ in range(round(share * n))]
    kinds = (kinds + ["greedy"] * n)[:n]
    rng.shuffle(kinds)
    bad = bad_cases(model)
    jobs = []
    for i, kind in enumerate(kinds):
        p = rng.randrange(len(pool))
        endpoint = rng.choice(("completions", "chat/completions"))
        prompt = pool[p]["text"]
        if kind in ("greedy", "greedy-stream"):
            m = rng.choice(GREEDY_MAX_TOKENS)
            jobs.append(Job(i, kind, f"prompt {p}", endpoint, greedy_body(model, endpoint, prompt, m),
                            stream=kind == "greedy-stream", greedy_key=(endpoint, p, m)))
        elif kind == "sampled":
            extra = {"temperature": rng.choice((0.3, 0.8, 1.0, 1.5)), "top_p": rng.choice((1.0, 0.9, 0.5)),
                     "top_k": rng.choice((-1, 20, 100)), "seed": rng.choice((None, rng.randrange(2**31)))}
            body = greedy_body(model, endpoint, prompt, rng.choice(SAMPLED_MAX_TOKENS))
            jobs.append(Job(i, kind, "sampled", endpoint, {**body, **extra}, stream=rng.random() < 0.3))
        elif kind == "odd":
            name, endpoint, body, greedy_max = rng.choice(odd_cases(model, prompt))
            key = None
            if greedy_max is not None:
                key = (endpoint, p, greedy_max)
            jobs.append(Job(i, kind, name, endpoint, body, stream=bool(body.get("stream")), greedy_key=key))
        elif kind == "bad":
            name, endpoint, body = bad[i % len(bad)]
            jobs.append(Job(i, kind, name, endpoint, body if isinstance(body, dict) else None,
                            raw=body if isinstance(body, bytes) else None, expect="4xx"))
        elif kind == "stream-disconnect":
            body = greedy_body(model, endpoint, prompt, 64)
            jobs.append(Job(i, kind, f"prompt {p}", endpoint, body, stream=True, greedy_key=(endpoint, p, 64),
                            hang_up_after=rng.randint(1, 12)))
        else:  # abort: a plain request the client gives up on before its answer
            body = greedy_body(model, endpoint, prompt, 64)
            jobs.append(Job(i, kind, f"prompt {p}", endpoint, body, greedy_key=(endpoint, p, 64),
                            give_up_after_s=rng.uniform(0.05, 1.5)))
    return jobs


def greedy_keys(jobs: list[Job]) -> set[tuple]:
    return {j.greedy_key for j in jobs if j.greedy_key is not None}
