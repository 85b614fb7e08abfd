"""Client-server MoA speculative decoding through the Python API, with a lost connection.

The demo target is served on 127.0.0.1 (in this process, a background thread); the MoA drafter
runs "on the device" (this process too) and talks to the server through a netsim proxy with a
50 ms round-trip time. Midway the link goes down for a second: the client keeps drafting alone
(tokens marked unverified), reconnects, has the target verify the unverified tail, rolls back
from the first rejected token and continues. The final text equals plain greedy decoding.

    python examples/client_server.py
    python examples/client_server.py --rtt-ms 200 --down-s 2 --drafter eagle
"""

from __future__ import annotations

import argparse
import json
import threading

import torch
from transformers import AutoTokenizer

from vllm_moa.decoding.chain import plain_greedy_generate
from vllm_moa.models import load_drafter
from vllm_moa.serving.backend import TransformersBackend
from vllm_moa.serving.client import RemoteDraftingClient, Transcript
from vllm_moa.serving.netsim import LinkConditions, NetSim
from vllm_moa.serving.server import ServerThread, create_app
from vllm_moa.shipped import SHIPPED
from vllm_moa.target import TargetModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="moa-tli0",
                        help="shipped drafter: moa-tli0 | moa-tli1 | eagle | independent")
    parser.add_argument("--prompt", default="def read_config(path):\n    \"\"\"Read a config file.\"\"\"\n")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rtt-ms", type=float, default=50.0)
    parser.add_argument("--down-after", type=int, default=32, help="verified tokens before the link goes down")
    parser.add_argument("--down-s", type=float, default=1.0, help="seconds the link stays down")
    args = parser.parse_args()
    torch.set_num_threads(1)

    # server side: the target (+ the MoA drafters' LSA weights, to make their sync rows)
    name = json.loads((SHIPPED / "moa-tli0" / "config.json").read_text())["target"]["name"]
    backend = TransformersBackend.from_pretrained(SHIPPED / "target", {"moa-tli0": SHIPPED / "moa-tli0",
                                                                       "moa-tli1": SHIPPED / "moa-tli1"},
                                                  target_name=name)
    # device side: the drafter, and the target's embedding / LM head (the demo loads the whole tiny
    # target; only those parts run here)
    target = TargetModel.from_pretrained(SHIPPED / "target")
    target.name = name
    drafter = load_drafter(SHIPPED / args.drafter, target).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED / "target"))
    prompt_ids = tokenizer(args.prompt)["input_ids"]

    server = ServerThread(create_app(backend))
    with server, NetSim(server.port, LinkConditions(rtt_ms=args.rtt_ms)) as link:
        view = Transcript()
        went_down = threading.Event()

        def on_event(event) -> None:
            view.apply(event)
            marks = {"verified": "+", "unverified": "?", "rollback": "<"}
            if event.kind in marks:
                print(f"{marks[event.kind]} {event.kind:10s} at {event.start:3d}: {tokenizer.decode(event.tokens)!r}")
            if view.num_verified >= args.down_after and not went_down.is_set():
                went_down.set()
                print(f"--- link down for {args.down_s:.1f}s ---")
                link.set_down("refuse", seconds=args.down_s)

        with RemoteDraftingClient(link.url, drafter, target, timeout=2.0, backoff_max_s=0.25) as client:
            result = client.generate(prompt_ids, args.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                     on_event=on_event)

    expected = plain_greedy_generate(target, prompt_ids, args.max_new_tokens, eos_token_id=tokenizer.eos_token_id)
    assert result.token_ids == expected.token_ids == view.tokens, "client-server output differs from greedy decoding"
    print("\n" + args.prompt + tokenizer.decode(result.token_ids))
    print(f"\n{len(result.token_ids)} tokens, all verified by the target ({result.num_verified}); identical to plain "
          f"greedy decoding")
    print(f"server calls {result.calls}, bytes sent {result.bytes_sent}, received {result.bytes_received}, "
          f"acceptance length {result.acceptance_length:.2f}")
    print(f"disconnects {result.disconnects}: {result.offline_tokens} tokens drafted offline, "
          f"{result.offline_confirmed} confirmed at resync, {result.rolled_back_tokens} rolled back")


if __name__ == "__main__":
    main()
