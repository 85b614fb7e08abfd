"""Record how close the vLLM-native MoA drafter is to the transformers drafter, on CPU.

    python -m benchmarks.vllm_cpu_numerics [--python .venv-vllm/bin/python]

Runs tests/integration/vllm/test_vllm_model.py (vLLM's loader and layers, fp32, paged attention by
a PyTorch twin; see that file) with the interpreter of an environment that has vLLM installed,
collects the worst absolute logit difference each test prints, and writes
benchmarks/results/vllm_cpu_numerics.json with the versions of that environment.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/integration/vllm/test_vllm_model.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_cpu_numerics.json")
    args = parser.parse_args()
    run = subprocess.run([args.python, "-m", "pytest", TEST, "-m", "vllm", "-s", "-v", "-p", "no:cacheprovider"],
                         cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{TEST} failed:\n{run.stdout[-3000:]}\n{run.stderr[-2000:]}")
    worst: dict[str, float] = {}
    current = None
    for line in run.stdout.splitlines():
        test = re.match(r"^(\S+::\S+)", line)
        if test:
            current = test.group(1).split("::", 1)[1]
        diff = re.search(r"worst \|logit diff\| ([0-9.e+-]+)", line)
        if diff and current:
            worst[current] = float(diff.group(1))
    if not worst:
        raise SystemExit("the tests printed no logit differences")
    versions = subprocess.run([args.python, "-c", "import json, torch, vllm, transformers; print(json.dumps("
                               "{'vllm': vllm.__version__, 'torch': torch.__version__, "
                               "'transformers': transformers.__version__}))"],
                              capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    report = {
        "benchmark": "vllm_cpu_numerics",
        "what": "worst |logit difference| between vllm_moa.integration.moa.draft_model.MoADraftModel (vLLM layers and "
                "loader, paged attention by a PyTorch twin) and vllm_moa.models.moa.MoADrafter, fp32, per test",
        "tolerance_asserted": 1e-4,
        "worst_abs_logit_diff": worst,
        "provenance": {"device": "cpu", "cpu": platform.machine(), "python": platform.python_version(),
                       **json.loads(versions), "date": time.strftime("%Y-%m-%d")},
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
