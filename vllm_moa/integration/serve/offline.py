"""One configuration of vLLM's offline engine (`vllm.LLM`), run in a child process, and what it
produced: token ids, wall times and vLLM's own metrics (spec-decode counters, prefix-cache hits,
preemptions).

The engine tests, `benchmarks/vllm_cpu_engine.py` and `examples/offline_inference.py` all drive
vLLM through this module. A child process per engine keeps every run independent (vLLM starts
its engine core and workers as further processes; they all end with the child, which runs in its
own process group and is killed whole on a timeout), and lets a test assert that nothing is
left behind.

    python -m vllm_moa.integration.serve.offline run.json result.json

Only vLLM's public API is used here (LLM, SamplingParams, TokensPrompt, get_metrics).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from vllm_moa.integration.serve.request_stream import StreamTimes, replay

# vLLM's metric names (vllm/v1/spec_decode/metrics.py, vllm/v1/metrics/loggers.py)
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
PREEMPTIONS = "vllm:num_preemptions"
INTER_TOKEN = "vllm:inter_token_latency_seconds"  # per request and step: the time between its outputs


class RequestStreamSpec(BaseModel):
    """Requests arriving one by one (request_stream.py): prompt i added at arrivals[i] seconds from
    the stream's start, generating max_tokens[i] tokens (greedy unless the run says otherwise)."""

    model_config = ConfigDict(extra="forbid")

    rate: float = Field(gt=0)  # requests per second the arrivals were drawn at (reported back)
    arrivals: list[float]
    max_tokens: list[int]


class EngineRun(BaseModel):
    """What to run: one engine, the same prompts `passes` times (later passes hit the prefix cache)."""

    model_config = ConfigDict(extra="forbid")

    target: str
    speculative_config: dict[str, Any] | None = None
    prompts: list[list[int]]  # token ids
    max_tokens: int = Field(64, gt=0)
    temperature: float | list[float] = 0.0  # one for all requests, or one per prompt
    seed: int | None = 0  # request i samples with seed + i
    # further SamplingParams keywords, one dict per prompt (top_k, top_p, n, logprobs, seed, ...);
    # they override temperature / seed for that request
    sampling: list[dict[str, Any]] | None = None
    ignore_eos: bool = True  # generate max_tokens for every request (benchmarks, comparisons)
    # one entry per pass over all prompts: how many requests are submitted together (0: all at
    # once; c: consecutive groups of c, each generated to the end before the next: concurrency c).
    # Later passes over the same prompts hit the prefix cache.
    passes: list[int] = Field(default_factory=lambda: [0], min_length=1)
    # per pass: how many of the prompts it runs (the first n; default: all of them)
    pass_prompts: list[int] | None = None
    # request streams over the prompts, after the passes (one entry per stream)
    streams: list[RequestStreamSpec] = Field(default_factory=list)
    # EngineArgs keywords (dtype, max_model_len, max_num_seqs, max_num_batched_tokens,
    # num_gpu_blocks_override, enable_prefix_caching, tensor_parallel_size, ...); enforce_eager
    # and disable_log_stats=False are set unless given.
    engine: dict[str, Any] = Field(default_factory=dict)
    # read each worker's MoA tap traffic after the passes (tensor parallelism; vLLM's
    # collective_rpc with a function, which vLLM allows with VLLM_ALLOW_INSECURE_SERIALIZATION=1:
    # run_engine sets it in the child for such runs)
    tap_traffic: bool = False


class SpecDecodeCounters(BaseModel):
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = Field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """vLLM's mean acceptance length: 1 + accepted / drafts (nan without drafts)."""
        return 1 + self.accepted / self.drafts if self.drafts else float("nan")

    def minus(self, earlier: SpecDecodeCounters) -> SpecDecodeCounters:
        """What was counted since `earlier` (vLLM's counters only grow)."""
        per_pos = [a - b for a, b in zip(self.accepted_per_pos, earlier.accepted_per_pos or [0] * len(self.accepted_per_pos))]
        return SpecDecodeCounters(drafts=self.drafts - earlier.drafts, draft_tokens=self.draft_tokens - earlier.draft_tokens,
                                  accepted=self.accepted - earlier.accepted, accepted_per_pos=per_pos)

    def plus(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        per_pos = [a + b for a, b in zip(self.accepted_per_pos or [0] * len(other.accepted_per_pos),
                                         other.accepted_per_pos or [0] * len(self.accepted_per_pos))]
        return SpecDecodeCounters(drafts=self.drafts + other.drafts, draft_tokens=self.draft_tokens + other.draft_tokens,
                                  accepted=self.accepted + other.accepted, accepted_per_pos=per_pos)


class PassResult(BaseModel):
    concurrency: int  # requests submitted together
    outputs: list[list[int]]  # [prompt] -> generated token ids (its first completion)
    completions: list[list[list[int]]] = Field(default_factory=list)  # [prompt][n] when a request asked for n > 1
    # [prompt] -> the sampled tokens' logprobs as vLLM returned them, when a request asked for logprobs
    logprobs: list[list[float] | None] = Field(default_factory=list)
    seconds: float  # wall time of the pass
    spec_decode: SpecDecodeCounters  # of this pass alone
    prefix_cache_hits: int = 0  # tokens, this pass alone
    preemptions: int = 0  # this pass alone
    inter_token_seconds: float | None = None  # vLLM's mean time between a request's outputs, this pass
    # [prompt] -> the draft tokens its request verified, where the engine was built with
    # per_request_spec_decode_metrics (EngineRun.engine); else empty
    draft_tokens: list[int | None] = Field(default_factory=list)


class StreamResult(StreamTimes):
    """A request stream's outcome (StreamTimes: per request, in seconds from the stream's start)."""

    rate: float
    spec_decode: SpecDecodeCounters  # of this stream alone


class EngineResult(BaseModel):
    passes: list[PassResult]
    startup_seconds: float
    spec_decode: SpecDecodeCounters  # all passes
    prefix_cache_hits: int = 0  # tokens
    preemptions: int = 0
    vllm_version: str = ""
    orphans: bool = False  # processes of the child's group outlived it (set by run_engine)
    tap_traffic: list[dict[str, Any]] = Field(default_factory=list)  # per worker (EngineRun.tap_traffic)
    # the speculative config as the engine resolved it (for "moa": the options the plugin filled in)
    speculative_config: dict[str, Any] = Field(default_factory=dict)
    streams: list[StreamResult] = Field(default_factory=list)

    def first_passes(self, n: int) -> EngineResult:
        """This run as if it had stopped after its first `n` passes (each pass's requests are
        generated to the end before the next pass starts, so the first passes do not depend on
        the later ones): the same passes, and the counters of those passes alone."""
        if not 0 < n <= len(self.passes):
            raise ValueError(f"a run of {len(self.passes)} passes has no first {n}")
        kept = self.passes[:n]
        counters = SpecDecodeCounters()
        for done in kept:
            counters = counters.plus(done.spec_decode)
        return self.model_copy(update={"passes": kept, "spec_decode": counters,
                                       "prefix_cache_hits": sum(p.prefix_cache_hits for p in kept),
                                       "preemptions": sum(p.preemptions for p in kept)})


class EngineRunFailed(RuntimeError):
    """The engine did not start or did not finish; the message ends with its last log lines.
    `log`: the child's whole output; `orphans`: whether processes of its group outlived it."""

    def __init__(self, message: str, log: str, orphans: bool, timed_out: bool = False) -> None:
        super().__init__(message)
        self.log, self.orphans, self.timed_out = log, orphans, timed_out

    @classmethod
    def from_log(cls, what: str, log: str, orphans: bool, timed_out: bool = False) -> EngineRunFailed:
        """"vLLM engine run <what>: <the log's root causes>", then the log's last lines."""
        return cls(f"vLLM engine run {what}: {root_causes(log)}\n--- last lines:\n" + "\n".join(log.splitlines()[-25:]),
                   log, orphans, timed_out)


def spec_decode_counters(metrics: list) -> SpecDecodeCounters:
    """vLLM's spec-decode counters from LLM.get_metrics() (needs disable_log_stats=False)."""
    from vllm.v1.metrics.reader import Counter, Vector

    counters = SpecDecodeCounters()
    for metric in metrics:
        if isinstance(metric, Counter):
            field = {DRAFTS: "drafts", DRAFT_TOKENS: "draft_tokens", ACCEPTED: "accepted"}.get(metric.name)
            if field:
                setattr(counters, field, getattr(counters, field) + int(metric.value))
        elif isinstance(metric, Vector) and metric.name == ACCEPTED_PER_POS:
            per_pos = counters.accepted_per_pos or [0] * len(metric.values)
            counters.accepted_per_pos = [a + int(b) for a, b in zip(per_pos, metric.values)]
    return counters


def histogram_totals(metrics: list, name: str) -> tuple[float, int]:
    """(sum, count) of a vLLM histogram in LLM.get_metrics()."""
    from vllm.v1.metrics.reader import Histogram

    found = [m for m in metrics if isinstance(m, Histogram) and m.name == name]
    return sum(float(m.sum) for m in found), sum(int(m.count) for m in found)


def counter_total(metrics: list, name: str) -> int:
    from vllm.v1.metrics.reader import Counter

    return sum(int(m.value) for m in metrics if isinstance(m, Counter) and m.name == name)


class Meters(BaseModel):
    """One engine's cumulative counters at one moment (LLM.get_metrics()); a pass's own figures are
    the difference of two readings. With several engines in one process, put the engine's own
    collectors back first (engine_metrics.show_only): vLLM keeps only the last engine's."""

    spec_decode: SpecDecodeCounters = Field(default_factory=SpecDecodeCounters)
    prefix_cache_hits: int = 0  # tokens
    preemptions: int = 0
    inter_token: tuple[float, int] = (0.0, 0)  # vLLM's inter-token histogram: (sum of seconds, count)

    @classmethod
    def read(cls, llm: Any) -> Meters:
        metrics = llm.get_metrics()
        return cls(spec_decode=spec_decode_counters(metrics), prefix_cache_hits=counter_total(metrics, PREFIX_CACHE_HITS),
                   preemptions=counter_total(metrics, PREEMPTIONS), inter_token=histogram_totals(metrics, INTER_TOKEN))

    def since(self, earlier: Meters) -> dict[str, Any]:
        """PassResult's counter fields for what happened between `earlier` and this reading."""
        steps = self.inter_token[1] - earlier.inter_token[1]
        return {"spec_decode": self.spec_decode.minus(earlier.spec_decode),
                "prefix_cache_hits": self.prefix_cache_hits - earlier.prefix_cache_hits,
                "preemptions": self.preemptions - earlier.preemptions,
                "inter_token_seconds": (self.inter_token[0] - earlier.inter_token[0]) / steps if steps else None}


def build_llm(run: EngineRun) -> tuple[Any, float]:
    """The run's engine in this process and its start-up seconds."""
    from vllm import LLM

    kwargs = {"enforce_eager": True, "disable_log_stats": False, **run.engine}
    start = time.perf_counter()
    llm = LLM(model=run.target, speculative_config=run.speculative_config, **kwargs)
    return llm, time.perf_counter() - start


def requests_of(run: EngineRun) -> tuple[list[Any], list[Any]]:
    """The run's prompts as vLLM TokensPrompts, and one SamplingParams per prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    temperatures = run.temperature if isinstance(run.temperature, list) else [run.temperature] * len(run.prompts)
    if len(temperatures) != len(run.prompts) or min(temperatures, default=0) < 0:
        raise ValueError(f"need one temperature >= 0 per prompt, got {len(temperatures)} for {len(run.prompts)}")
    extra = run.sampling or [{}] * len(run.prompts)
    if len(extra) != len(run.prompts):
        raise ValueError(f"need one sampling dict per prompt, got {len(extra)} for {len(run.prompts)}")
    sampling = [SamplingParams(**{"temperature": t, "max_tokens": run.max_tokens, "ignore_eos": run.ignore_eos,
                                  "seed": None if run.seed is None else run.seed + i, **more})
                for i, (t, more) in enumerate(zip(temperatures, extra))]
    return [TokensPrompt(prompt_token_ids=ids) for ids in run.prompts], sampling


def pass_sizes(run: EngineRun) -> list[tuple[int, int]]:
    """Per pass: (requests submitted together, prompts it runs)."""
    sizes = run.pass_prompts or [len(run.prompts)] * len(run.passes)
    if len(sizes) != len(run.passes) or not all(0 < n <= len(run.prompts) for n in sizes):
        raise ValueError(f"pass_prompts needs one count in 1..{len(run.prompts)} per pass, got {sizes}")
    return [(group or count, count) for group, count in zip(run.passes, sizes)]


def run_pass(llm: Any, prompts: list[Any], sampling: list[Any], size: int, meters: Meters, *,
             per_request: bool = False, many: bool = False, wants_logprobs: bool = False) -> tuple[PassResult, Meters]:
    """One pass: the prompts in consecutive groups of `size`, each generated to the end before the
    next (concurrency `size`); its counters are those since `meters`, returned with the new reading.
    per_request: read each request's verified draft tokens (an engine built with
    per_request_spec_decode_metrics); many / wants_logprobs: keep every completion / the sampled
    logprobs (execute sets them where any request of the run asks)."""
    outputs: list[list[int]] = []
    completions: list[list[list[int]]] = []
    logprobs: list[list[float] | None] = []
    draft_tokens: list[int | None] = []
    start = time.perf_counter()
    for first in range(0, len(prompts), size):
        done = llm.generate(prompts[first:first + size], sampling[first:first + size], use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in done]
        completions += [[list(c.token_ids) for c in o.outputs] for o in done] if many else []
        logprobs += [sampled_logprobs(o.outputs[0]) for o in done] if wants_logprobs else []
        draft_tokens += [request_draft_tokens(o.outputs[0]) for o in done] if per_request else []
    seconds = time.perf_counter() - start
    now = Meters.read(llm)
    return PassResult(concurrency=min(size, len(prompts)), outputs=outputs, completions=completions, logprobs=logprobs,
                      draft_tokens=draft_tokens, seconds=seconds, **now.since(meters)), now


def stream_result(llm: Any, prompts: list[Any], sampling: list[Any], stream: RequestStreamSpec,
                  meters: Meters) -> tuple[StreamResult, Meters]:
    """One request stream (run_stream), its spec-decode counters since `meters`, and the new reading."""
    times = run_stream(llm, prompts, sampling, stream)
    now = Meters.read(llm)
    return StreamResult(**times.model_dump(), rate=stream.rate, spec_decode=now.spec_decode.minus(meters.spec_decode)), now


def execute(run: EngineRun) -> EngineResult:
    """Run `run` in this process (the child's side of run_engine)."""
    import vllm

    llm, startup = build_llm(run)
    try:
        resolved = resolved_speculative_config(llm.llm_engine.vllm_config.speculative_config)
        prompts, sampling = requests_of(run)
        wanted = {"per_request": run.engine.get("per_request_spec_decode_metrics", "none") != "none",
                  "many": any(p.n > 1 for p in sampling),  # any request of the run: every pass keeps them
                  "wants_logprobs": any(p.logprobs is not None for p in sampling)}
        passes, streams, meters = [], [], Meters()
        for size, count in pass_sizes(run):
            done, meters = run_pass(llm, prompts[:count], sampling[:count], size, meters, **wanted)
            passes.append(done)
        for stream in run.streams:
            done_stream, meters = stream_result(llm, prompts, sampling, stream, meters)
            streams.append(done_stream)
        traffic = []
        if run.tap_traffic:
            from vllm_moa.integration.moa.tensor_parallel import worker_tap_traffic

            traffic = [t for t in llm.collective_rpc(worker_tap_traffic) if t]
        return EngineResult(
            passes=passes, startup_seconds=startup, spec_decode=meters.spec_decode,
            prefix_cache_hits=meters.prefix_cache_hits, preemptions=meters.preemptions,
            vllm_version=vllm.__version__, tap_traffic=traffic, speculative_config=resolved, streams=streams,
        )
    finally:
        shutdown(llm)


def run_stream(llm: Any, prompts: list[Any], sampling: list[Any], stream: RequestStreamSpec) -> StreamTimes:
    """One request stream over the first len(stream.arrivals) prompts, each with its own max_tokens."""
    count = len(stream.arrivals)
    if len(stream.max_tokens) != count or count > len(prompts):
        raise ValueError(f"a stream needs one max_tokens per arrival and at most {len(prompts)} arrivals, got "
                         f"{len(stream.max_tokens)} and {count}")
    params = [p.clone() for p in sampling[:count]]
    for p, tokens in zip(params, stream.max_tokens):
        p.max_tokens = tokens
    return replay(llm, prompts[:count], params, stream.arrivals, tag=f"stream{stream.rate:g}")


def shutdown(llm: Any) -> None:
    """Shut an LLM's engine core and workers down now (not when the object is collected): a
    process that runs several engines one after another (engine_host.py) starts each clean."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


RESOLVED_FIELDS = ("method", "model", "num_speculative_tokens", "num_speculative_tokens_per_batch_size", "moa_tree",
                   "moa_retrieval", "moa_adaptive")


def resolved_speculative_config(spec: Any) -> dict[str, Any]:
    """The fields of a built SpeculativeConfig a result reports ({} without speculation)."""
    if spec is None:
        return {}
    return {name: getattr(spec, name) for name in RESOLVED_FIELDS if getattr(spec, name, None) is not None}


def request_draft_tokens(completion: Any) -> int | None:
    """The draft tokens a finished request verified (vLLM's per-request spec-decode metrics)."""
    metrics = getattr(completion, "spec_decode_metrics", None)
    return None if metrics is None else int(metrics.num_draft_tokens)


def sampled_logprobs(completion: Any) -> list[float] | None:
    """The logprob vLLM returned for each sampled token of a CompletionOutput (None: not asked)."""
    if completion.logprobs is None:
        return None
    return [float(step[token].logprob) for token, step in zip(completion.token_ids, completion.logprobs)]


# vLLM's CPU backend otherwise reserves gpu_memory_utilization (0.92) of the machine's memory for
# its KV cache, and refuses to start when other processes hold more than the rest.
CPU_KV_CACHE_ENV, CPU_KV_CACHE_GIB = "VLLM_CPU_KVCACHE_SPACE", "2"


def run_engine(run: EngineRun, *, timeout: float = 900, env: dict[str, str] | None = None,
               python: str = sys.executable, workdir: Path | None = None) -> EngineResult:
    """Run `run` in a child process (its own process group) and return its result; raises
    EngineRunFailed with the child's root causes and last log lines when it fails or runs past
    `timeout`. `env` adds to this process's environment; the CPU KV cache is 2 GiB unless
    VLLM_CPU_KVCACHE_SPACE is set."""
    import tempfile

    env = {CPU_KV_CACHE_ENV: os.environ.get(CPU_KV_CACHE_ENV, CPU_KV_CACHE_GIB), **(env or {})}
    if run.tap_traffic:
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function (EngineRun.tap_traffic)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        spec, out = Path(tmp) / "run.json", Path(tmp) / "result.json"
        spec.write_text(run.model_dump_json())
        log = Path(tmp) / "log.txt"
        with log.open("wb") as log_file:
            child = subprocess.Popen([python, "-m", __name__, str(spec), str(out)], stdout=log_file,
                                     stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     start_new_session=True)
            try:
                code = child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                orphans = kill_process_group(child.pid)
        if code != 0 or not out.is_file():
            text = log.read_text(errors="replace")
            what = f"ran past {timeout:.0f} s" if code is None else f"exited with {code}"
            raise EngineRunFailed.from_log(what, text, orphans, timed_out=code is None)
        result = EngineResult.model_validate_json(out.read_text())
        result.orphans = orphans
        return result


def root_causes(log: str) -> str:
    """The distinct exception lines of a vLLM log ("ValueError: ..."), worker and engine-core
    prefixes removed: what went wrong, without the traceback."""
    causes: list[str] = []
    for line in log.splitlines():
        match = re.search(r"\b([A-Z]\w*(?:Error|Exception|Mismatch)): (.*)$", line)
        if match and (cause := f"{match[1]}: {match[2]}") not in causes:
            causes.append(cause)
    return " | ".join(causes[:4]) or "no exception in the log"


def kill_process_group(pgid: int) -> bool:
    """End the child's process group (engine core and workers included); returns whether any of
    it was still there."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    run = EngineRun.model_validate_json(Path(spec_path).read_text())
    result = execute(run)
    Path(out_path).write_text(result.model_dump_json())
    return 0


if __name__ == "__main__":  # vLLM starts its workers with spawn: the entry point must be guarded
    sys.exit(main(sys.argv[1:]))
