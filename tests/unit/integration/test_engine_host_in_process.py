"""EngineHost's in-process mode without vLLM (integration/serve/engine_host.py): the thread binding
each forked run gives itself (vLLM gives a worker process the same through OMP's environment,
which an in-process engine never reads), and the runs it refuses before any child starts. The
engine tests run every offline engine through it (tests/integration/vllm/vllm_env.engine_host)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_moa.integration.serve.engine_host import EngineHost
from vllm_moa.integration.serve.offline import EngineRun

# one interpreter tries the masks in turn (a binding only narrows: the unbound cases first)
PROBE = """
import json, os, sys, torch
from vllm_moa.integration.serve.engine_host import bind_threads
seen = []
for mask in json.loads(sys.argv[1]):
    cores = bind_threads(mask)
    seen.append({"cores": cores, "affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()})
print(json.dumps(seen))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux's CPU affinity calls")
def test_a_forked_run_computes_on_the_cores_vllm_would_bind_one_thread_each():
    allowed = sorted(os.sched_getaffinity(0))
    unbound = [None, "auto", "nobind", "0|1"]  # the process's own cores, a thread each
    pair = [f"{allowed[0]}-{allowed[1]}" if allowed[1] == allowed[0] + 1 else f"{allowed[0]},{allowed[1]}"] \
        if len(allowed) > 1 else []
    masks = unbound + pair + [str(allowed[0])]
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(masks)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "3"})
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    want = [{"cores": allowed, "affinity": allowed, "threads": len(allowed)}] * len(unbound)
    want += [{"cores": allowed[:2], "affinity": allowed[:2], "threads": 2}] * len(pair)
    want += [{"cores": [allowed[0]], "affinity": [allowed[0]], "threads": 1}]
    assert seen == want


def test_an_in_process_host_refuses_tensor_parallel_runs_before_starting_anything():
    run = EngineRun(target="unused", prompts=[[1, 2]], engine={"tensor_parallel_size": 2})
    with EngineHost(in_process=True) as host:
        with pytest.raises(ValueError, match="tensor-parallel run needs vLLM's processes"):
            host.run(run)
        assert host._child is None
