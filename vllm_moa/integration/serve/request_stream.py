"""A stream of requests replayed into vLLM's offline engine as a server receives them: each request
added at its own arrival time while the engine runs the ones before it, through vLLM's public
`LLMEngine.add_request` / `step`. What a user's day looks like, unlike batches submitted together.

    arrivals = poisson_arrivals(rate=2.0, count=32, seed=0)     # seconds from the stream's start
    replay(llm, prompts, sampling, arrivals)  -> StreamTimes (per request: arrival, first token, end)

The engine loop is this process's: between steps it adds every request whose arrival time has
passed, and sleeps only while nothing runs.
"""

from __future__ import annotations

import random
import time
from typing import Any

from pydantic import BaseModel


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """`count` arrival times (seconds, the first at 0) of a Poisson process of `rate` requests/s."""
    if rate <= 0 or count < 1:
        raise ValueError(f"a request stream needs rate > 0 and count >= 1, got rate {rate}, count {count}")
    rng = random.Random(seed)
    times, now = [0.0], 0.0
    for _ in range(count - 1):
        now += rng.expovariate(rate)
        times.append(now)
    return times


class StreamTimes(BaseModel):
    """Per request, in seconds from the stream's start: when it was added, when its first token
    came out and when it finished; its token ids; the stream's wall time."""

    arrival: list[float]
    first_token: list[float]
    finished: list[float]
    outputs: list[list[int]]
    seconds: float


def replay(llm: Any, prompts: list[Any], sampling: list[Any], arrivals: list[float], tag: str = "stream") -> StreamTimes:
    """Add request i (prompts[i], sampling[i]) at arrivals[i] seconds from now and run the engine
    until every request finished."""
    if not (len(prompts) == len(sampling) == len(arrivals)):
        raise ValueError(f"a stream needs one prompt, sampling and arrival per request, got "
                         f"{len(prompts)}, {len(sampling)}, {len(arrivals)}")
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i])
    engine, n = llm.llm_engine, len(prompts)
    added, first, done, outputs = [None] * n, [None] * n, [None] * n, [None] * n
    start, cursor = time.perf_counter(), 0
    while cursor < n or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while cursor < n and arrivals[order[cursor]] <= now:
            i = order[cursor]
            engine.add_request(f"{tag}-{i}", prompts[i], sampling[i])
            added[i], cursor = now, cursor + 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[order[cursor]] - now))
            continue
        for output in engine.step():
            i = int(output.request_id.rsplit("-", 1)[1])
            stamp = time.perf_counter() - start
            if first[i] is None and output.outputs and output.outputs[0].token_ids:
                first[i] = stamp
            if output.finished:
                done[i], outputs[i] = stamp, list(output.outputs[0].token_ids)
    return StreamTimes(arrival=added, first_token=first, finished=done, outputs=outputs,
                       seconds=time.perf_counter() - start)
