"""The plain "API call" baseline of the remote-drafting client (a client without a drafter):
plain decoding on the server (/v1/generate), streamed."""

from __future__ import annotations

import time
from collections.abc import Iterator

from vllm_moa.serving.run_state import RunState, advance
from vllm_moa.serving.stream import ProtocolError, StreamEvent
from vllm_moa.serving.transport import TransientFailure


def api_events(client, run: RunState) -> Iterator[StreamEvent]:
    """`client`'s generation by plain decoding on its server, streamed. A dropped stream is
    resumed from the tokens received (greedy: exact); while the server is unreachable nothing is
    produced (the client's backoff, until its give_up_after_s)."""
    while not run.done:
        body = {"prompt": run.prompt + run.out, "max_tokens": run.max_tokens - len(run.out), "stream": True,
                "eos_token_id": run.eos, "sampling": client.sampling_body(run, salt=run.result.failures)}
        try:
            for line in client.transport.stream_lines("/v1/generate", body):
                if "tokens" in line:
                    if not isinstance(line["tokens"], list):
                        raise ProtocolError(f"stream line without a token list: {line!r:.200}")
                    new = [client.checked_token(t, "generated token") for t in line["tokens"]]
                    yield from advance(run, list(run.out), run.nv, run.out + new, run.nv + len(new))
                elif line.get("done"):
                    run.result.server_seconds += float(line.get("server_ms", 0.0)) / 1e3
                    if not run.done and line.get("finish_reason") == "eos":
                        run.done, run.result.finish_reason = True, "eos"
                    run.done = run.done or len(run.out) >= run.max_tokens
                    break
            run.offline, run.failures = False, 0
        except TransientFailure:
            client.went_offline(run)
            if time.monotonic() - run.offline_since > client.give_up_after_s:
                run.result.finish_reason = "disconnected"
                return
            time.sleep(max(0.0, run.next_try - time.monotonic()))
