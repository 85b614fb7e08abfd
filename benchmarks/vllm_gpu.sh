#!/usr/bin/env bash
# Bring vLLM 0.26.0 to the offline GPU machine and run the plugin's GPU checks there.
# Repeatable recipe (docs/vllm-plugin.md, "On the offline GPU machine"); three stages:
#
#   1. here, with network:   benchmarks/vllm_gpu.sh prepare
#        packs vLLM 0.26.0 + the packages the GPU image lacks (shared/tools/offline-vllm/prepare.py,
#        torch 2.11.0+cu130 and Triton are already there) into .xfer/site.tgz.partNN, 30 MiB each,
#        so that each device call can carry two parts (its carry limit is 64 MiB).
#   2. on the GPU machine, one device call per pair of parts (carry=[".xfer/site.tgz.partNN", ...]):
#        benchmarks/vllm_gpu.sh receive          # copies the carried parts to /tmp/xfer
#      then once:
#        benchmarks/vllm_gpu.sh unpack           # /tmp/site, import check, project install (no deps)
#   3. on the GPU machine:   benchmarks/vllm_gpu.sh check
#        plugin tests, offline generation vs plain vLLM (greedy, token-for-token), the server
#        example, the serving benchmark; results under $OUT (default /tmp/vllm-moa-gpu, fetch it
#        by writing under $OUT of the device call).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=${VLLM_VERSION:-0.26.0}
SITE=${SITE:-/tmp/site}
XFER=${XFER:-/tmp/xfer}
RESULTS=${RESULTS:-${OUT:-/tmp/vllm-moa-gpu}}

case "${1:-}" in
prepare)
    grep -qx '/.xfer/' .git/info/exclude 2>/dev/null || echo /.xfer/ >> .git/info/exclude
    python "${PREPARE:-../shared/tools/offline-vllm/prepare.py}" --vllm "$VLLM_VERSION" --out .xfer \
        --part-mb "${PART_MB:-30}" ${LEAN:+--lean}
    ls -l .xfer
    ;;
receive)
    mkdir -p "$XFER"
    cp -v .xfer/site.tgz.part* "$XFER"/
    ls -l "$XFER"
    ;;
unpack)
    mkdir -p "$SITE"
    cat "$XFER"/site.tgz.part* | tar xz -C "$SITE"
    export PYTHONPATH=$SITE
    python -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__, torch.cuda.get_device_name())'
    pip install --no-deps --no-build-isolation -e .
    python -c 'from importlib.metadata import entry_points as e; print([p for p in e(group="vllm.general_plugins")])'
    ;;
check)
    export PYTHONPATH=$SITE
    mkdir -p "$RESULTS"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RESULTS/gpu.txt"
    python -m pytest tests/integration/vllm -q -m vllm 2>&1 | tee "$RESULTS/pytest.txt"
    for k in 2 4; do
        python examples/offline_inference.py -k "$k" --check --json "$RESULTS/offline_k$k.json" \
            2>&1 | tee "$RESULTS/offline_k$k.log"
    done
    python examples/offline_inference.py -k 4 --check --enforce-eager --json "$RESULTS/offline_k4_eager.json" \
        2>&1 | tee "$RESULTS/offline_k4_eager.log"
    examples/serve.sh 2>&1 | tee "$RESULTS/serve.log"
    OUT="$RESULTS/bench" examples/benchmark.sh 2>&1 | tee "$RESULTS/bench.log"
    ;;
*)
    sed -n '2,20p' "$0"
    exit 2
    ;;
esac
