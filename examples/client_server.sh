#!/usr/bin/env bash
# Client-server speculative decoding from the command line: the demo target served on 127.0.0.1,
# then the MoA client (drafter on this machine) and the plain API-call baseline.
# Needs the [serve] extra (pip install 'vllm-moa[serve]'); CPU is enough.
#
#   examples/client_server.sh
#   PORT=8123 DRAFTER=eagle examples/client_server.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8000}
DRAFTER=${DRAFTER:-moa-tli0}
LOG=${LOG:-/tmp/vllm-moa-client-server.log}
# a bearer token for this run (clients without it get 401)
export VLLM_MOA_TOKEN=${VLLM_MOA_TOKEN:-$(python -c "import secrets; print(secrets.token_urlsafe(24))")}

# one torch thread each: server and client share this machine's cores
vllm-moa serve --port "$PORT" --threads 1 --log-level warning >"$LOG" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/v1/health" >/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { tail -50 "$LOG"; exit 1; }
    sleep 0.5
done

PROMPT='def read_config(path):
    """Read a config file."""
'
echo "== $DRAFTER drafter on this device, target on the server =="
vllm-moa client --url "http://127.0.0.1:$PORT" --drafter "$DRAFTER" --threads 1 --max-new-tokens 96 --prompt "$PROMPT"
echo
echo "== API-call baseline (the server generates alone) =="
vllm-moa client --url "http://127.0.0.1:$PORT" --drafter api --max-new-tokens 96 --prompt "$PROMPT"
