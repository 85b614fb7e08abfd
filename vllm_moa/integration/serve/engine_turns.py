"""Engines in one process that take turns step by step, each timed on a clock of its own, so that
the machine's speed, which on a shared 2-core machine wanders by ±10% within seconds, is the same
for every engine compared.

Two engines run one after another, even a minute apart, meet different machine speeds: on this
project's CPU machines a fixed matmul loop reads 0.76-1.11 of its mean over 2-second windows, and
engines without speculation run twice at one point differ by up to ±10%
(docs/vllm-plugin.md, "Engines side by side"). Here every engine of a comparison is in the middle
of its work at once: the engine whose own clock is furthest behind takes the next step (vLLM's
public `LLMEngine.add_request` / `step`), and its clock runs only during its own steps. Over any
stretch longer than a few steps every engine has run for the same seconds of the machine's time,
so a slow second slows them all alike and the ratio of their speeds keeps what differs between
the engines.

    clocks = [OwnClock() for _ in llms]
    for llm, clock in zip(llms, clocks): attach_clock(llm, clock)   # K by measured speed reads it
    turns = [EngineTurns(llm, prompts, sampling, clock, group=8) for llm, clock in zip(llms, clocks)]
    take_turns(turns)                   # every engine's pass: outputs, own seconds, step times

A workload is a pass (the prompts in consecutive groups of `group` requests, each group run to the
end before the next: concurrency `group`; with `in_flight`, `group` requests kept in flight
instead, a finished one's place taken by the next at once, as `vllm bench serve
--max-concurrency` keeps them) or a stream (request i added once the engine's own
clock reaches arrivals[i]; an engine with nothing to run jumps its clock to the next arrival, so
idle time costs nothing and is not measured). A "moa" engine that chooses K by measured speed
prices its steps by the time between their outputs (adaptive_k.AdaptiveK); `attach_clock` gives
its table the engine's own clock, or that time would include the other engines' steps.

The engines share the machine's caches in turn; each step streams its model's weights from memory
either way (SmolLM2's 540 MB in fp32 do not fit a cache), so this costs every engine alike.
vLLM's engine core must run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm_moa.integration.shell.adaptive_k import AdaptiveK


class OwnClock:
    """Seconds one engine has run: time.perf_counter's, counted only between resume() and pause()."""

    def __init__(self) -> None:
        self.total = 0.0
        self.since: float | None = None

    def __call__(self) -> float:
        return self.total + (time.perf_counter() - self.since if self.since is not None else 0.0)

    def resume(self) -> None:
        self.since = time.perf_counter()

    def pause(self) -> None:
        if self.since is not None:
            self.total += time.perf_counter() - self.since
            self.since = None

    def skip_to(self, moment: float) -> None:
        """Idle until `moment` of this clock, at no cost (a stream's next arrival)."""
        self.total = max(self.total, moment)


def scheduler_of(llm: Any) -> Any:
    """The scheduler of an `vllm.LLM` whose engine core runs in this process (vLLM's InprocClient)."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None or not hasattr(core, "scheduler"):
        raise RuntimeError("engine turns need vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    return core.scheduler


def attach_clock(llm: Any, clock: OwnClock) -> bool:
    """Have the engine's K by measured speed (if it has one) time its steps on `clock`; whether it
    has one. Call after the engine's first step, which installs the table."""
    table = scheduler_of(llm).dynamic_sd_lookup
    if not isinstance(table, AdaptiveK):
        return False
    table.clock = clock
    table.last_end = None  # the interval in progress was stamped on the other clock
    return True


@dataclass
class TurnsResult:
    """One engine's workload: per prompt its tokens and, in its own clock's seconds from the
    workload's start, when it was added, its first token came and it finished; the workload's own
    seconds, and every step's seconds and requests in flight."""

    outputs: list[list[int]]
    arrival: list[float]
    first_token: list[float]
    finished: list[float]
    seconds: float
    step_seconds: list[float] = field(default_factory=list)
    step_requests: list[int] = field(default_factory=list)


class EngineTurns:
    """One engine's pass (`group`: consecutive groups of that many requests, or with `in_flight`
    that many requests in flight) or stream (`arrivals`: seconds of its own clock from the start),
    taken one step per turn."""

    def __init__(self, llm: Any, prompts: list[Any], sampling: list[Any], clock: OwnClock, *,
                 group: int | None = None, arrivals: list[float] | None = None, in_flight: bool = False,
                 tag: str = "turns") -> None:
        if (group is None) == (arrivals is None):
            raise ValueError("a workload is a pass (group) or a stream (arrivals), one of them")
        if len(prompts) != len(sampling) or (arrivals is not None and len(arrivals) != len(prompts)):
            raise ValueError(f"need one sampling (and arrival) per prompt, got {len(prompts)} prompts, "
                             f"{len(sampling)} sampling, {None if arrivals is None else len(arrivals)} arrivals")
        if group is not None and group < 1:
            raise ValueError(f"a pass's group is at least 1 request, got {group}")
        if in_flight and group is None:
            raise ValueError("in_flight keeps a pass's `group` requests in flight; a stream has arrivals instead")
        self.engine, self.prompts, self.sampling, self.clock = llm.llm_engine, prompts, sampling, clock
        self.group, self.in_flight, self.tag, n = group, in_flight, tag, len(prompts)
        # the order requests are added in, with the own-clock second each may be added from
        self.due = sorted(range(n), key=lambda i: arrivals[i]) if arrivals is not None else list(range(n))
        self.arrivals = arrivals
        self.cursor = 0
        self.start = clock()
        self.result = TurnsResult(outputs=[[] for _ in range(n)], arrival=[0.0] * n, first_token=[0.0] * n,
                                  finished=[0.0] * n, seconds=0.0)
        self.left = n

    @property
    def done(self) -> bool:
        return self.left == 0

    @property
    def running(self) -> int:
        """Requests added and not finished."""
        return self.cursor - (len(self.due) - self.left)

    def _admit(self, now: float) -> None:
        """Add the requests whose time has come: a pass's next group once the last one ended (in
        flight: as many as have finished), a stream's arrivals up to now."""
        if self.group is not None:
            if self.running and not self.in_flight:
                return
            upto = min(len(self.due), self.cursor + self.group - self.running)
        else:
            upto = self.cursor
            while upto < len(self.due) and self.arrivals[self.due[upto]] <= now:
                upto += 1
        for i in self.due[self.cursor:upto]:
            self.engine.add_request(f"{self.tag}-{i}", self.prompts[i], self.sampling[i])
            self.result.arrival[i] = now
        self.cursor = upto

    def take_turn(self) -> None:
        """Admit what is due, then one engine step, on this engine's own clock; a stream with
        nothing to run first skips its clock to the next arrival."""
        now = self.clock() - self.start
        if self.arrivals is not None and self.cursor < len(self.due) and not self.engine.has_unfinished_requests():
            now = max(now, self.arrivals[self.due[self.cursor]])
            self.clock.skip_to(self.start + now)
        self.clock.resume()
        began = self.clock()
        self._admit(now)
        self.result.step_requests.append(self.running)
        outputs = self.engine.step()
        for output in outputs:
            i = int(output.request_id.rsplit("-", 1)[1])
            stamp = self.clock() - self.start
            if not self.result.first_token[i] and output.outputs and output.outputs[0].token_ids:
                self.result.first_token[i] = stamp
            if output.finished:
                self.result.finished[i], self.result.outputs[i] = stamp, list(output.outputs[0].token_ids)
                self.left -= 1
        self.result.step_seconds.append(self.clock() - began)
        self.clock.pause()
        self.result.seconds = self.clock() - self.start


def take_turns(turns: list[EngineTurns]) -> list[TurnsResult]:
    """Run every workload to its end, the engine whose own clock is furthest behind stepping next
    (ties: the order given)."""
    while True:
        waiting = [t for t in turns if not t.done]
        if not waiting:
            return [t.result for t in turns]
        min(waiting, key=lambda t: t.clock() - t.start).take_turn()
