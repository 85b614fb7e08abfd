"""Several engine configurations, one after another, in one child process: vLLM is imported once
for all of them, where `offline.run_engine` starts a child per configuration.

Each run is still one `vllm.LLM` of its own (its engine core and workers started for it and shut
down after it: `offline.execute`), logged to a file of its own (the child's stdout and stderr are
redirected to it for the run, so what the engine core and workers print lands in it too), and
checked for processes that outlive it (its orphans, killed then so that the next run starts
clean). A run that fails raises `EngineRunFailed` as run_engine's do; a run past its time, or a
child that died, ends the child, and the next run starts a new one. Runs that need an environment
of their own (another thread binding, other drafter options read from the environment) need a
host of their own: the environment is the child's.

`in_process=True`: each run is a fork of the child, which imported vLLM once, and its engine runs
inside that fork (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0: engine core and worker in one
process, vLLM's UniProcExecutor) instead of in the two processes vLLM spawns per engine, which
import torch and vLLM again (about 20 s of CPU each on a 2-core machine) and busy-poll each
other between steps. The fork gives every run a fresh copy of the child (no patch, metric or
distributed state of one run reaches the next); the child itself never runs an engine, so it
has started no thread to fork. The fork binds its compute threads as vLLM binds a worker's
(VLLM_CPU_OMP_THREADS_BIND; vLLM does it through OMP's environment at a worker process's start,
which an in-process engine never has: without it two engines side by side each ran 2 threads
over both cores, several times slower). Tensor parallelism needs vLLM's processes (one per rank): such a
run raises ValueError here.

    python -m vllm_moa.integration.serve.engine_host FOLDER    (the child's side: runs N.run.json
                                                                 for each N read from stdin)
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from vllm_moa.integration.serve.offline import (
    CPU_KV_CACHE_ENV,
    CPU_KV_CACHE_GIB,
    EngineResult,
    EngineRun,
    EngineRunFailed,
    kill_process_group,
)

ORPHAN_GRACE_S = 5.0  # a run's processes still alive this long after its engine shut down are orphans
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"  # vLLM's: "0" runs the engine core in the caller's process
FORK_EACH_RUN = "--fork-each-run"
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM CPU's: the cores a worker computes on
# what an in-process run imports, imported once by the child before its first fork
PRELOADED = ("torch", "transformers", "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine",
             "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
             "vllm.model_executor.models.llama", "vllm.v1.spec_decode.eagle", "vllm.v1.sample.rejection_sampler",
             "vllm_moa.integration.serve.offline")


class EngineHost:
    """A child process that runs `EngineRun`s one after another (started on the first run)."""

    def __init__(self, env: dict[str, str] | None = None, python: str = sys.executable,
                 in_process: bool = False) -> None:
        self.env = {CPU_KV_CACHE_ENV: os.environ.get(CPU_KV_CACHE_ENV, CPU_KV_CACHE_GIB), **(env or {})}
        if in_process:
            self.env[IN_PROCESS_ENV] = "0"
        self.in_process = in_process
        self.python = python
        self._folder = tempfile.TemporaryDirectory(prefix="vllm-moa-engine-host-")
        self._child: subprocess.Popen | None = None
        self._numbers = itertools.count()

    def run(self, run: EngineRun, *, timeout: float = 900) -> EngineResult:
        if run.tap_traffic:
            raise ValueError("a run reading the tap's traffic needs VLLM_ALLOW_INSECURE_SERIALIZATION: use run_engine")
        if self.in_process and run.engine.get("tensor_parallel_size", 1) > 1:
            raise ValueError("a tensor-parallel run needs vLLM's processes, one per rank: use a host with in_process=False")
        if self._child is None or self._child.poll() is not None:
            self._start()
        number, folder = next(self._numbers), Path(self._folder.name)
        (folder / f"{number}.run.json").write_text(run.model_dump_json())
        out, log = folder / f"{number}.out.json", folder / f"{number}.log"
        assert self._child is not None and self._child.stdin is not None
        self._child.stdin.write(f"{number}\n")
        self._child.stdin.flush()
        deadline = time.monotonic() + timeout
        while not out.is_file():
            if self._child.poll() is not None or time.monotonic() > deadline:
                timed_out = self._child.poll() is None
                what = f"ran past {timeout:.0f} s" if timed_out else f"ended its host process (exit {self._child.returncode})"
                orphans = self.close()
                text = log.read_text(errors="replace") if log.is_file() else ""
                raise EngineRunFailed.from_log(what, text, orphans, timed_out=timed_out)
            time.sleep(0.05)
        answer = json.loads(out.read_text())
        if "error" in answer:
            raise EngineRunFailed.from_log("failed", log.read_text(errors="replace"), answer["orphans"])
        result = EngineResult.model_validate(answer["result"])
        result.orphans = answer["orphans"]
        return result

    def _start(self) -> None:
        mode = [FORK_EACH_RUN] if self.in_process else []
        self._child = subprocess.Popen([self.python, "-m", __name__, self._folder.name, *mode], stdin=subprocess.PIPE,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                                       env={**os.environ, **self.env}, start_new_session=True)

    def close(self) -> bool:
        """End the child and its process group; returns whether any of it was still there."""
        child, self._child = self._child, None
        if child is None:
            return False
        if child.poll() is None and child.stdin is not None:
            child.stdin.close()  # the child's loop ends at the end of its input
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        return kill_process_group(child.pid)

    def __enter__(self) -> EngineHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self._folder.cleanup()


# -- the child's side ----------------------------------------------------------------------------
def _serve_one(folder: Path, number: str) -> None:
    import psutil

    from vllm_moa.integration.serve.offline import execute

    run = EngineRun.model_validate_json((folder / f"{number}.run.json").read_text())
    saved = os.dup(1), os.dup(2)
    with (folder / f"{number}.log").open("wb") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            answer = {"result": execute(run).model_dump(mode="json")}
        except Exception as error:  # the parent raises it, with this run's log
            traceback.print_exc()
            answer = {"error": f"{type(error).__name__}: {error}"}
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    # multiprocessing's resource tracker, which the first spawned engine starts, lives as long as
    # this process: the one child that is not a run's
    children = [p for p in psutil.Process().children(recursive=True) if not _is_resource_tracker(p)]
    _, alive = psutil.wait_procs(children, timeout=ORPHAN_GRACE_S)
    for process in alive:
        process.kill()
    answer["orphans"] = bool(alive)
    _write_answer(folder, number, answer)


def _write_answer(folder: Path, number: str, answer: dict) -> None:
    """N.out.json, whole or not at all (the parent polls for it)."""
    partial = folder / f"{number}.out.json.partial"
    partial.write_text(json.dumps(answer))
    partial.rename(folder / f"{number}.out.json")


def _is_resource_tracker(process) -> bool:
    import psutil

    try:
        return any("multiprocessing.resource_tracker" in part for part in process.cmdline())
    except psutil.Error:  # it ended meanwhile
        return False


def bind_threads(mask: str | None) -> list[int]:
    """In this process, what vLLM's CPU executor gives a worker process it starts through OMP's
    environment (read only when a process starts, so an in-process engine never gets it): compute
    threads on the cores of VLLM_CPU_OMP_THREADS_BIND ("0", "0-1", "0,2-3"), one per core. "auto",
    "nobind", unset, or one list per rank ("0|1"): this process's cores. Returns the cores."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    if mask and mask not in ("auto", "nobind") and "|" not in mask:
        cores = sorted({core for part in mask.split(",") for core in _core_range(part)})
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return cores


def _core_range(part: str) -> range:
    first, _, last = part.strip().partition("-")
    return range(int(first), int(last or first) + 1)


def _serve_forked(folder: Path, number: str) -> None:
    """_serve_one in a fork of this process: the run's engine, in-process there, ends with it."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            bind_threads(os.environ.get(THREADS_BIND_ENV))
            _serve_one(folder, number)
        except BaseException:  # noqa: BLE001 (the fork must end here whatever happened)
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if not (folder / f"{number}.out.json").is_file():  # it died before answering (a signal, a crash)
        _write_answer(folder, number, {"error": f"the run's process ended without an answer (wait status {status})",
                                       "orphans": False})


def main(argv: list[str]) -> int:
    folder, fork_each_run = Path(argv[0]), FORK_EACH_RUN in argv[1:]
    if fork_each_run:
        import importlib

        for name in PRELOADED:  # a head start only: what one vLLM lacks, its runs import as they need
            try:
                importlib.import_module(name)
            except ImportError:
                pass
    for line in sys.stdin:
        if line.strip():
            (_serve_forked if fork_each_run else _serve_one)(folder, line.strip())
    return 0


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the entry point must be guarded
    sys.exit(main(sys.argv[1:]))
