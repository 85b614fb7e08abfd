"""Engine runs that vLLM must refuse before its engine starts, all the cases of a test file checked
in one child process (a plain module, like vllm_env.py): vLLM is imported once for them all
instead of once per case, and each case is still tried, logged and judged on its own.

In the child each case runs `offline.execute` (LLM(...), as run_engine's child does) with the
process's stdout and stderr redirected to that case's log, so that what vLLM's engine core and
workers print, if the case gets that far, lands in it too. A case passes as refused when LLM(...)
raised by itself within its time; its processes still alive 2 s after the refusal are its
orphans (killed then, so that the next case starts clean).

    python refusals.py cases.json results.json
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from pydantic import BaseModel, TypeAdapter

from vllm_moa.integration.serve.offline import CPU_KV_CACHE_ENV, EngineRun, root_causes

CASE_SECONDS = 300  # a case that runs longer hangs


class Refusal(BaseModel):
    refused: bool  # LLM(...) raised by itself (not: it started, or it hung)
    message: str  # what went wrong (the log's root causes), then the log's last lines
    log: str
    orphans: bool  # processes the case started outlived its refusal


def refusals(runs: dict[str, EngineRun], env: dict[str, str] | None = None) -> dict[str, Refusal]:
    """Try every run of `runs` in one child process; what each case came to, by name."""
    with tempfile.TemporaryDirectory() as tmp:
        cases, out = Path(tmp) / "cases.json", Path(tmp) / "results.json"
        cases.write_text(TypeAdapter(dict[str, EngineRun]).dump_json(runs).decode())
        child_env = {**os.environ, CPU_KV_CACHE_ENV: "1", **(env or {})}
        done = subprocess.run([sys.executable, __file__, str(cases), str(out)], env=child_env, capture_output=True,
                              text=True, timeout=CASE_SECONDS * len(runs) + 60, start_new_session=True)
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"the refusal child exited with {done.returncode}:\n{done.stdout[-3000:]}")
        return TypeAdapter(dict[str, Refusal]).validate_json(out.read_text())


def _try(run: EngineRun, log_path: Path) -> Refusal:
    import psutil

    from vllm_moa.integration.serve.offline import execute

    saved = os.dup(1), os.dup(2)
    with log_path.open("wb") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        signal.alarm(CASE_SECONDS)
        try:
            execute(run)
            refused, what = False, "the engine started: the run was not refused"
        except _Hung:
            refused, what = False, f"ran past {CASE_SECONDS} s"
        except Exception:
            traceback.print_exc()
            refused, what = True, "refused"
        finally:
            signal.alarm(0)
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
    _, alive = psutil.wait_procs(psutil.Process().children(recursive=True), timeout=2)
    for process in alive:
        process.kill()
    text = log_path.read_text(errors="replace")
    message = f"{what}: {root_causes(text)}\n--- last lines:\n" + "\n".join(text.splitlines()[-25:])
    return Refusal(refused=refused, message=message, log=text, orphans=bool(alive))


class _Hung(Exception):
    pass


def _alarm(signum, frame):
    raise _Hung


def main(argv: list[str]) -> int:
    cases_path, out_path = map(Path, argv)
    runs = TypeAdapter(dict[str, EngineRun]).validate_json(cases_path.read_text())
    signal.signal(signal.SIGALRM, _alarm)
    results = {name: _try(run, out_path.parent / f"case-{i}.log") for i, (name, run) in enumerate(runs.items())}
    out_path.write_text(TypeAdapter(dict[str, Refusal]).dump_json(results).decode())
    return 0


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the entry point must be guarded
    sys.exit(main(sys.argv[1:]))
