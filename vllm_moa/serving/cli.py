"""`vllm-moa serve` and `vllm-moa client` (registered on the main CLI by `register(app)`).

    vllm-moa serve                                   # demo target + its MoA drafters on 127.0.0.1:8000
    VLLM_MOA_TOKEN=... vllm-moa serve --host 0.0.0.0 --target path/to/target --drafter moa=path/to/drafter
                                                     # (beyond loopback without tokens: refused unless --insecure)
    vllm-moa client --prompt "def read_config(path):"            # MoA drafter on this device
    vllm-moa client --prompt "..." --drafter api                  # the plain API-call baseline

FastAPI / uvicorn / httpx are imported inside the commands: the rest of the CLI works without the
[serve] extra.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import typer

from vllm_moa.cli_flags import chat_option, drafter_weights_option, lookup_option, model_values, with_model_flags
from vllm_moa.serving.protocol import ServerLimits


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def _exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def _set_threads(threads: int) -> None:
    if threads < 0:
        raise ValueError(f"--threads must be >= 0, got {threads}")
    if threads:
        import torch

        torch.set_num_threads(threads)


@with_model_flags(ServerLimits)
def serve(
    target: Optional[Path] = typer.Option(None, help="Target directory (default: the shipped demo target)."),
    drafter: list[str] = typer.Option([], help="Drafter the server keeps in sync, NAME=DIR or a shipped name "
                                               "(repeatable; MoA needs its LSA weights here). Default: the demo's "
                                               "moa-tli0 and moa-tli1 when serving the demo target."),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on. Anything but loopback needs bearer tokens "
                                               "(or --insecure)."),
    insecure: bool = typer.Option(False, "--insecure", help="Allow listening beyond loopback without bearer tokens "
                                                            "(a trusted network only)."),
    port: int = typer.Option(8000, help="TCP port."),
    backend: str = typer.Option("transformers", help="Target backend: transformers | vllm."),
    device: str = typer.Option("cpu", help="transformers backend device: cpu | cuda | cuda:N."),
    vllm_engine_args: str = typer.Option("{}", help="vllm backend: EngineArgs keywords as a JSON object, e.g. "
                                                    "'{\"max_model_len\": 4096, \"dtype\": \"bfloat16\"}'."),
    live_sessions: int = typer.Option(-1, help="vllm backend: sessions that keep a resumable vLLM request between "
                                               "rounds, so that a chain round computes only its own tokens (-1: half "
                                               "of max_num_seqs; 0: every round is a new request)."),
    token_file: Optional[Path] = typer.Option(None, help="File of bearer tokens, one per line (each names a client)."),
    token_env: str = typer.Option("VLLM_MOA_TOKEN", help="Environment variable with comma-separated bearer tokens."),
    log_level: str = typer.Option("info", help="uvicorn log level."),
    threads: int = typer.Option(0, help="torch CPU threads (0 = torch's default). Use 1 when the client runs on "
                                        "the same machine: two processes spinning 2 threads each on 2 cores "
                                        "slow both down many times over."),
    min_forward_ms: float = typer.Option(0.0, help="Benchmarks: make every target forward take at least this "
                                                   "long (emulates a larger, memory-bound target)."),
    **limit_flags,
) -> None:
    """Serve a target for remote drafting clients: session verification and plain generation."""
    from pydantic import ValidationError

    from vllm_moa.config import DrafterConfigError, DrafterTargetMismatch
    from vllm_moa.serving.backend import BACKENDS, BackendError, BackendUnavailable
    from vllm_moa.serving.security import check_exposure, is_loopback, load_tokens
    from vllm_moa.serving.server import create_app
    from vllm_moa.serving.server import serve as run
    from vllm_moa.shipped import SHIPPED, drafter_directory
    from vllm_moa.target import UnsupportedTargetError

    try:
        _set_threads(threads)
        factories = {**BACKENDS, **_EXTRA_BACKENDS}
        if backend not in factories:
            raise ValueError(f"--backend must be one of {', '.join(factories)}, got {backend!r}")
        engine_args = json.loads(vllm_engine_args) if backend == "vllm" else {}
        if not isinstance(engine_args, dict):
            raise ValueError(f"--vllm-engine-args must be a JSON object, got {vllm_engine_args!r}")
        limits = ServerLimits(**model_values(ServerLimits, limit_flags))
        tokens = load_tokens(None, token_file, token_env)
        check_exposure(host, bool(tokens), insecure)  # before any model is loaded
        demo = target is None
        target_dir = SHIPPED / "target" if demo else target
        specs = drafter or (["moa-tli0", "moa-tli1"] if demo else [])
        drafters = {}
        for spec in specs:
            name, _, path = spec.partition("=") if "=" in spec else (spec, "", spec)
            drafters[name] = drafter_directory(path)
        name = None
        if demo:  # the demo drafters record the demo target's published name
            name = json.loads((SHIPPED / "moa-tli0" / "config.json").read_text())["target"]["name"]
        if backend == "vllm":
            engine = factories["vllm"](target_dir, drafters, target_name=name,
                                       live_sessions=None if live_sessions < 0 else live_sessions, **engine_args)
        else:
            engine = BACKENDS["transformers"].from_pretrained(target_dir, drafters, device=device, target_name=name,
                                                              min_forward_ms=min_forward_ms)
    except ValidationError as err:
        first = err.errors()[0]
        _fail(f"invalid option {'.'.join(str(p) for p in first['loc'])}: {first['msg']}")
    except (ValueError, FileNotFoundError, DrafterConfigError, DrafterTargetMismatch, UnsupportedTargetError,
            BackendUnavailable, BackendError, OSError) as err:
        _fail(str(err))
    if not tokens and not is_loopback(host):  # only with --insecure (check_exposure)
        typer.secho(f"warning: listening on {host} without bearer tokens (--insecure): anyone who can reach it may "
                    f"use it", fg=typer.colors.YELLOW, err=True)
    typer.echo(f"serving {engine.signature.name} ({engine.name}{f', {device}' if backend != 'vllm' else ''}) on "
               f"http://{host}:{port} "
               f"with drafters: {', '.join(d.name for d in engine.drafters()) or 'none'}; "
               f"auth: {'bearer tokens' if tokens else 'off'}", err=True)
    # uvicorn re-raises SIGTERM once it has shut down gracefully: exit through `finally` then, so
    # that the backend releases what it holds (the vLLM backend's engine-core processes)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        run(create_app(engine, limits, tokens), host=host, port=port, log_level=log_level, insecure=insecure)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        engine.shutdown()


def client(
    prompt: str = typer.Option(..., help="Prompt text."),
    url: str = typer.Option("http://127.0.0.1:8000", help="Server URL."),
    drafter: str = typer.Option("moa-tli0", help="Local drafter: a directory, a shipped demo drafter (moa-tli0, "
                                                 "moa-tli1, eagle, independent), 'ngram', or 'api' (no drafter: "
                                                 "plain generation on the server)."),
    target: Optional[Path] = typer.Option(None, help="Local copy of the target for the drafter's shared parts "
                                                     "(embedding, LM head, last TLI layers) and the tokenizer "
                                                     "(default: the shipped demo target)."),
    max_new_tokens: int = typer.Option(128, help="Tokens to generate."),
    num_draft: int = typer.Option(0, help="Fixed draft depth (0 = adapt to round-trip time and acceptance)."),
    tree_top_k: int = typer.Option(0, help="Draft EAGLE-2 trees this wide (0 = chains)."),
    chain_if_faster: bool = typer.Option(True, help="With --tree-top-k: each round the tree or a chain, whichever "
                                                    "has measured more tokens per second (--no-chain-if-faster: "
                                                    "the tree every round)."),
    pipeline: int = typer.Option(2, min=1, max=8, help="Rounds in flight at most: a chain's next round is drafted "
                                                       "past it and sent before its verdict while that measurably "
                                                       "pays (1: every round waits for its verdict)."),
    encoding: str = typer.Option("fp16", help="Drafter-sync payload: fp16 | int8."),
    temperature: float = typer.Option(0.0, help="0 = greedy (output equals the target's greedy decoding), as is "
                                                "anything below 1e-5; at most 100."),
    top_k: int = typer.Option(0, help="Top-k warping (0 = off)."),
    top_p: float = typer.Option(1.0, help="Top-p warping (1 = off)."),
    seed: Optional[int] = typer.Option(None, help="Seed for reproducible sampling."),
    timeout: float = typer.Option(10.0, help="Seconds before a call counts as lost (then: offline drafting)."),
    give_up_after: float = typer.Option(60.0, help="Seconds offline before returning unverified tokens as they are."),
    token_env: str = typer.Option("VLLM_MOA_TOKEN", help="Environment variable holding the bearer token."),
    json_output: bool = typer.Option(False, "--json", help="Print the result and its metrics as JSON."),
    threads: int = typer.Option(0, help="torch CPU threads (0 = torch's default; 1 next to a local server)."),
    drafter_weights: str = drafter_weights_option(),
    lookup: bool = lookup_option(),
    chat: bool = chat_option(),
) -> None:
    """Generate with a local drafter against a verification server; drafts on alone offline.

    Streams the target-verified text; a lost connection makes the client draft alone (unverified
    tokens), then resync with the server, rolling back from the first token the target rejects."""
    from transformers import AutoTokenizer

    from vllm_moa import registry as kinds
    from vllm_moa.chat import encode_prompt
    from vllm_moa.config import DrafterConfigError, DrafterTargetMismatch
    from vllm_moa.decoding.sampling import SamplingParams
    from vllm_moa.models import load_named
    from vllm_moa.packed_linear import check_drafter_weights
    from vllm_moa.serving.client import (
        ProtocolError,
        RemoteDraftingClient,
        RequestRefused,
        ServerUnavailable,
        Transcript,
    )
    from vllm_moa.shipped import SHIPPED
    from vllm_moa.target import TargetModel, UnsupportedTargetError

    try:
        _set_threads(threads)
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        check_drafter_weights(drafter_weights, "--drafter-weights")  # before any model loads
        target_dir = target or SHIPPED / "target"
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        local_target = None
        if drafter not in ("api", *kinds.names(lambda kind: kind.model_free)):
            local_target = TargetModel.from_pretrained(target_dir)
            if target is None:
                local_target.name = json.loads((SHIPPED / "moa-tli0" / "config.json").read_text())["target"]["name"]
        model = load_named(None if drafter == "api" else drafter, local_target, drafter_weights)
        prompt_ids = encode_prompt(tokenizer, prompt, chat)
        remote = RemoteDraftingClient(url, model, local_target, token=os.environ.get(token_env) or None,
                                      encoding=encoding, num_draft=num_draft or None, tree_top_k=tree_top_k or None,
                                      timeout=timeout, give_up_after_s=give_up_after, tokenizer=tokenizer,
                                      lookup=lookup, chain_if_faster=chain_if_faster, pipeline=pipeline)
        view = Transcript()
        printed = 0
        offline_noted = False

        def show(event) -> None:
            nonlocal printed, offline_noted
            view.apply(event)
            if json_output:
                return
            if event.kind == "unverified" and not offline_noted:
                typer.secho("\n[connection lost: drafting alone, tokens unverified]", fg=typer.colors.YELLOW, err=True)
                offline_noted = True
            if event.kind == "rollback":
                typer.secho(f"\n[resynced: target rejected drafts from token {event.start}]", fg=typer.colors.YELLOW,
                            err=True)
            if event.kind == "verified":
                if offline_noted:
                    typer.secho("[verified again]", fg=typer.colors.GREEN, err=True)
                    offline_noted = False
                text = tokenizer.decode(view.tokens[: view.num_verified])
                sys.stdout.write(text[printed:])
                sys.stdout.flush()
                printed = len(text)

        with remote:
            result = remote.generate(prompt_ids, max_new_tokens, sampling, seed, tokenizer.eos_token_id, on_event=show)
    except (ValueError, FileNotFoundError, DrafterConfigError, DrafterTargetMismatch, UnsupportedTargetError,
            RequestRefused, ServerUnavailable, ProtocolError) as err:
        _fail(str(err))
    summary = {
        "tokens": len(result.token_ids), "verified": result.num_verified, "finish_reason": result.finish_reason,
        "seconds": round(result.seconds, 3), "server_calls": result.calls, "verify_calls": result.verify_calls,
        "bytes_sent": result.bytes_sent, "bytes_received": result.bytes_received,
        "acceptance_length": round(result.acceptance_length, 3), "disconnects": result.disconnects,
        "offline_tokens": result.offline_tokens, "offline_confirmed": result.offline_confirmed,
        "rollbacks": result.rollbacks, "reopens": result.reopens, "lookup_rounds": result.lookup_rounds,
        "shape_rounds": result.shape_rounds, "pipelined_rounds": result.pipelined_rounds,
        "pipelined_verified": result.pipelined_verified,
    }
    if json_output:
        typer.echo(json.dumps({"text": result.text, "token_ids": result.token_ids, **summary}, indent=2))
        return
    if result.num_verified < len(result.token_ids):
        typer.secho(tokenizer.decode(result.token_ids[result.num_verified:]), dim=True, nl=False)
        typer.secho("\n[the tail above was never verified: the server stayed unreachable]", fg=typer.colors.YELLOW,
                    err=True)
    typer.echo(f"\n[{summary['tokens']} tokens ({summary['verified']} verified), "
               f"{summary['server_calls']} server calls, "
               f"{(result.bytes_sent + result.bytes_received) / max(1, len(result.token_ids)):.0f} bytes/token, "
               f"acceptance length {result.acceptance_length:.2f}, {result.seconds:.2f}s]", err=True)


# backends of a layer above serving (the vLLM one, vllm_moa/integration): given by the CLI
_EXTRA_BACKENDS: dict[str, Callable] = {}


def register(app: typer.Typer, backends: dict[str, Callable] | None = None) -> None:
    """Add `serve` and `client` to the CLI; `backends`: name -> factory(target_dir, drafter_dirs,
    target_name=..., **engine_args) of further target backends."""
    _EXTRA_BACKENDS.update(backends or {})
    app.command("serve")(serve)
    app.command("client")(client)
