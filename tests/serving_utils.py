"""Helpers for the client-server tests: tiny drafters of every kind, a real uvicorn server on
127.0.0.1 in a background thread, `vllm-moa serve` as a subprocess, and a backend whose target
forwards can be held at a gate."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time

import torch

from vllm_moa.kinds import ModelFreeDrafter
from vllm_moa.kinds.eagle import EagleDrafter, EagleDrafterConfig
from vllm_moa.kinds.independent import IndependentDrafter, IndependentDrafterConfig
from vllm_moa.kinds.moa import MoAConfig, MoADrafter
from vllm_moa.serving.backend import TransformersBackend
from vllm_moa.serving.protocol import ServerLimits
from vllm_moa.serving.server import ServerThread, create_app

DRAFTER_KINDS = ("moa-tli0", "moa-tli1", "eagle", "independent", "ngram")


def tiny_drafters(target, seed: int = 0) -> dict:
    """Random (untrained) drafters of every kind for `target`: their drafts are mostly rejected,
    which exercises rollbacks hard."""
    torch.manual_seed(seed)
    return {
        "moa-tli0": MoADrafter(MoAConfig(target=target.signature, tli=0)).eval(),
        "moa-tli1": MoADrafter(MoAConfig(target=target.signature, tli=1)).eval(),
        "eagle": EagleDrafter(EagleDrafterConfig(target=target.signature)).eval(),
        "independent": IndependentDrafter(IndependentDrafterConfig(target=target.signature)).eval(),
        "ngram": "ngram",
    }


class GatedBackend(TransformersBackend):
    """The real backend with a gate after every target forward: while `gate` is clear, the first
    forward to run (after `free_forwards` more) waits there, holding the target, so every later
    request queues behind it, as behind a slow target. `in_forward` is set once a forward waits at
    the gate; `closing` once a session close has been asked for."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate, self.in_forward, self.closing = threading.Event(), threading.Event(), threading.Event()
        self.gate.set()
        self.free_forwards = 0

    def _floor(self, started: float) -> None:
        super()._floor(started)
        if self.free_forwards > 0:
            self.free_forwards -= 1
        elif not self.gate.is_set():
            self.in_forward.set()
            self.gate.wait()

    def close(self, session) -> None:
        self.closing.set()
        super().close(session)


@contextlib.contextmanager
def running_server(target, drafters: dict, limits: ServerLimits | None = None, tokens: list[str] | None = None,
                   backend_cls: type[TransformersBackend] = TransformersBackend, **app_kwargs):
    """Yields (url, app, backend) of a real server on 127.0.0.1 (a free port)."""
    backend = backend_cls(target, {k: v for k, v in drafters.items() if not isinstance(v, (str, ModelFreeDrafter))})
    app = create_app(backend, limits, tokens, **app_kwargs)
    server = ServerThread(app)
    url = server.start()
    try:
        yield url, app, backend
    finally:
        server.stop()


CLI = [sys.executable, "-m", "vllm_moa.cli"]


@contextlib.contextmanager
def cli_server(*serve_args: str, env: dict, start_timeout: float = 300.0):
    """Yields the URL of `vllm-moa serve --port <free> --log-level warning --threads 1 *serve_args`
    in a subprocess, once /v1/health answers 200 (its output is the failure message if it never
    does); terminated afterwards."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([*CLI, "serve", "--port", str(port), "--log-level", "warning", "--threads", "1",
                               *serve_args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                if httpx.get(f"{url}/v1/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, server.stdout.read()
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)
