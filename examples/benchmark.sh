#!/usr/bin/env bash
# Serving benchmark with vLLM's own client (`vllm bench serve`): MoA vs n-gram vs no speculation,
# on the held-out demo prompts, at several concurrencies; one JSON per run (acceptance rate,
# acceptance length and per-position acceptance come from the server's spec-decode metrics).
# Needs a GPU and vLLM 0.26. Results: benchmarks/results/vllm_serve/ (or OUT=...).
#
#   examples/benchmark.sh
#   TARGET=path/to/llama DRAFTER=runs/moa/drafter PROMPTS=prompts.jsonl examples/benchmark.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEMO=vllm_moa/assets/demo
TARGET=${TARGET:-$DEMO/target}
DRAFTER=${DRAFTER:-$DEMO/moa-tli0}
K=${K:-4}
PORT=${PORT:-8011}
OUT=${OUT:-benchmarks/results/vllm_serve}
CONCURRENCY=${CONCURRENCY:-"1 4 16 64"}
NUM_PROMPTS=${NUM_PROMPTS:-64}
OUTPUT_LEN=${OUTPUT_LEN:-128}
mkdir -p "$OUT"

PROMPTS=${PROMPTS:-$OUT/demo_prompts.jsonl}
if [ ! -f "$PROMPTS" ]; then   # vLLM's "custom" dataset: one {"prompt": ...} per line
    python - "$PROMPTS" <<'PY'
import json, sys
rows = json.load(open("vllm_moa/assets/demo/heldout_prompts.json"))
with open(sys.argv[1], "w") as f:
    for row in rows:
        f.write(json.dumps({"prompt": row["text"]}) + "\n")
PY
fi

run() {   # name, extra server args...
    local name=$1; shift
    vllm serve "$TARGET" --port "$PORT" --max-model-len 2048 --gpu-memory-utilization "${GPU_MEM:-0.5}" "$@" \
        >"$OUT/server_$name.log" 2>&1 &
    local server=$!
    for _ in $(seq 600); do
        curl -sf "http://localhost:$PORT/health" >/dev/null && break
        kill -0 "$server" 2>/dev/null || { tail -50 "$OUT/server_$name.log"; return 1; }
        sleep 1
    done
    for c in $CONCURRENCY; do
        vllm bench serve --backend vllm --base-url "http://localhost:$PORT" --model "$TARGET" \
            --dataset-name custom --dataset-path "$PROMPTS" --skip-chat-template \
            --custom-output-len "$OUTPUT_LEN" --num-prompts "$NUM_PROMPTS" --max-concurrency "$c" \
            --temperature 0 --ignore-eos --save-result --result-dir "$OUT" \
            --result-filename "${name}_c${c}.json"
    done
    kill "$server"; wait "$server" 2>/dev/null || true
}

run moa_k$K --speculative-config "{\"method\": \"moa\", \"model\": \"$DRAFTER\", \"num_speculative_tokens\": $K}"
run ngram_k$K --speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $K, \"prompt_lookup_max\": 4}"
run plain
ls "$OUT"/*.json
