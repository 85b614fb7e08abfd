"""Client-server deployment (docs/method.md section 4): the target verifies on a server, the
drafter runs on the user's device and is kept in sync with the target by small payloads.

    protocol.py   request/response schemas (pydantic) with hard limits
    payload.py    tensors on the wire: fp16 or int8 (per-row scale), base64
    backend.py    TargetBackend: per-session target caches, tree verification with decoding/
    sessions.py   what the server holds: sessions (TTL, reaper), generations in flight, limits in
                  all and per client, the token budget
    security.py   bearer-token auth and the request body limit (both before parsing), loopback-only
                  without tokens
    server.py     FastAPI app factory, `serve` runner, `ServerThread` for tests and benchmarks
    local.py      client-side drafter sessions fed by server payloads (+ offline drafting)
    adaptive.py   draft length from measured round-trip time and acceptance
    client.py     RemoteDraftingClient: draft, verify, stream; survives lost connections
    netsim.py     in-process TCP proxy: latency, bandwidth, loss, hard drops (seeded)
    cli.py        `vllm-moa serve`, `vllm-moa client`
"""
