"""Reproducible network conditions on this machine's loopback: an asyncio TCP proxy.

    client --> 127.0.0.1:proxy --[latency, bandwidth, loss, drops]--> 127.0.0.1:server

* latency: each chunk arrives rtt/2 after it left, in each direction (+ optional jitter);
* bandwidth: one shared link per direction; a chunk occupies it len*8/bandwidth seconds;
* loss: TCP never loses bytes, it retransmits: a chunk is "lost" with probability `loss` and then
  arrives `rto_ms` later (and holds back what follows it on that connection, as TCP does);
* hard drops: `cut()` resets every connection now; `cut_after_bytes(n)` resets them once n more
  bytes have crossed (the chunk is split, so requests and responses are cut mid-way), then the
  proxy can stay down: `refuse` (connections reset on accept: connection refused / reset) or
  `blackhole` (accepted, never answered: the client times out), for a time or a number of
  connection attempts.

Everything random comes from one seeded generator. Addresses are loopback only: the proxy
refuses to listen on or forward to anything else.

`NetSimProcess` runs the same proxy in a child process (benchmarks: so that its timers do not
wait on the client's Python thread) behind the same control methods.
"""

from __future__ import annotations

import asyncio
import ipaddress
import multiprocessing as mp
import random
import threading
from dataclasses import dataclass, field, replace

_READ = 16384


@dataclass(frozen=True)
class LinkConditions:
    rtt_ms: float = 0.0
    bandwidth_mbit: float | None = None  # None: unlimited
    loss: float = 0.0
    rto_ms: float = 200.0
    jitter_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.rtt_ms < 0 or self.jitter_ms < 0 or self.rto_ms < 0:
            raise ValueError("rtt_ms, jitter_ms and rto_ms must be >= 0")
        if self.bandwidth_mbit is not None and self.bandwidth_mbit <= 0:
            raise ValueError(f"bandwidth_mbit must be > 0 (or None), got {self.bandwidth_mbit}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")


@dataclass
class NetStats:
    bytes_up: int = 0  # client -> server
    bytes_down: int = 0  # server -> client
    connections: int = 0
    refused: int = 0
    cuts: int = 0
    reset_connections: int = 0  # open connections that cuts reset
    lost_chunks: int = 0


def _check_loopback(host: str) -> None:
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"netsim only works on the loopback interface; refusing {host!r}")


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)
    closed: bool = False

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        for writer in (self.client, self.upstream):
            if writer is not None:
                writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class NetSim:
    def __init__(self, upstream_port: int, conditions: LinkConditions | None = None, seed: int = 0,
                 host: str = "127.0.0.1", listen_port: int = 0) -> None:
        _check_loopback(host)
        self.host, self.upstream_port, self.listen_port = host, upstream_port, listen_port
        self.conditions = conditions or LinkConditions()
        self.rng = random.Random(seed)
        self.stats = NetStats()
        self._conns: set[_Conn] = set()
        self._link_free = {"up": 0.0, "down": 0.0}
        self._down: str | None = None  # None | "refuse" | "blackhole"
        self._down_until: float | None = None
        self._down_left: int | None = None  # connection attempts still refused
        self._cut_budget: int | None = None
        self._after_cut: tuple[str | None, float | None, int | None] = (None, None, None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> str:
        """Start in a background thread; returns the proxy's URL (http://127.0.0.1:PORT)."""
        ready = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._handle, self.host, self.listen_port))
                self.listen_port = self._server.sockets[0].getsockname()[1]
            except BaseException as err:  # reported to start()
                error.append(err)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            self._server.close()
            for conn in list(self._conns):
                conn.abort()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True, name="netsim")
        self._thread.start()
        ready.wait()
        if error:
            raise error[0]
        return self.url

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.listen_port}"

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop = None

    def __enter__(self) -> NetSim:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- control (thread-safe) -------------------------------------------------------------------
    def _call(self, fn, *args):
        if self._loop is None:
            return fn(*args)
        done = threading.Event()
        out: list = []

        def wrapped() -> None:
            out.append(fn(*args))
            done.set()

        self._loop.call_soon_threadsafe(wrapped)
        done.wait()
        return out[0]

    def set_conditions(self, conditions: LinkConditions) -> None:
        self._call(setattr, self, "conditions", conditions)

    def cut(self) -> None:
        """Reset every open connection now."""
        self._call(self._cut_all)

    def set_down(self, mode: str | None, seconds: float | None = None, connections: int | None = None) -> None:
        """mode refuse | blackhole: existing connections are reset and new ones refused /
        swallowed, for `seconds` or `connections` attempts (or until set_down(None))."""
        if mode not in (None, "refuse", "blackhole"):
            raise ValueError(f"mode must be None, 'refuse' or 'blackhole', got {mode!r}")
        self._call(self._set_down, mode, seconds, connections)

    def cut_after_bytes(self, n: int, then: str | None = None, seconds: float | None = None,
                        connections: int | None = None) -> None:
        """Reset every connection once n more bytes have crossed (either direction); then go down
        as in set_down(then, seconds, connections)."""
        if n < 0:
            raise ValueError("n must be >= 0")
        self._call(self._arm_cut, n, then, seconds, connections)

    def disarm(self) -> None:
        """Forget a pending cut_after_bytes."""
        self._call(self._arm_cut, None, None, None, None)

    def snapshot(self) -> NetStats:
        return self._call(lambda: replace(self.stats))

    # -- inside the loop ----------------------------------------------------------------------------
    def _arm_cut(self, n, then, seconds, connections) -> None:
        self._cut_budget = n
        self._after_cut = (then, seconds, connections)

    def _set_down(self, mode, seconds, connections) -> None:
        self._down = mode
        self._down_until = None if seconds is None else self._loop.time() + seconds
        self._down_left = connections
        if mode is not None:
            self._cut_all()

    def _is_down(self) -> str | None:
        if self._down is None:
            return None
        if self._down_until is not None and self._loop.time() >= self._down_until:
            self._down = None
            return None
        if self._down_left is not None:
            if self._down_left <= 0:
                self._down = None
                return None
            self._down_left -= 1
        return self._down

    def _cut_all(self) -> None:
        self.stats.cuts += 1
        self.stats.reset_connections += len(self._conns)
        for conn in list(self._conns):
            conn.abort()
        self._conns.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        down = self._is_down()
        if down == "refuse":
            self.stats.refused += 1
            writer.transport.abort()
            return
        conn = _Conn(writer)
        self._conns.add(conn)
        if down == "blackhole":
            self.stats.refused += 1
            try:
                while await reader.read(_READ):
                    pass
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                conn.abort()
                self._conns.discard(conn)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            conn.abort()
            self._conns.discard(conn)
            return
        conn.upstream = up_writer
        if conn.closed:  # cut while connecting
            up_writer.transport.abort()
            return
        for src, dst, direction in ((reader, up_writer, "up"), (up_reader, writer, "down")):
            queue: asyncio.Queue = asyncio.Queue()
            conn.tasks.append(asyncio.create_task(self._read(conn, src, queue, direction)))
            conn.tasks.append(asyncio.create_task(self._write(conn, dst, queue)))
        try:
            await asyncio.gather(*conn.tasks, return_exceptions=True)
        finally:
            conn.abort()
            self._conns.discard(conn)

    async def _read(self, conn: _Conn, reader: asyncio.StreamReader, queue: asyncio.Queue, direction: str) -> None:
        last = 0.0
        try:
            while True:
                data = await reader.read(_READ)
                if not data:
                    queue.put_nowait(None)
                    return
                cut_here = False
                if self._cut_budget is not None:
                    if len(data) >= self._cut_budget:
                        data, cut_here = data[: self._cut_budget], True
                        self._cut_budget = None
                    else:
                        self._cut_budget -= len(data)
                c = self.conditions
                now = self._loop.time()
                start = max(now, self._link_free[direction])
                tx = len(data) * 8 / (c.bandwidth_mbit * 1e6) if c.bandwidth_mbit else 0.0
                self._link_free[direction] = start + tx
                deliver = start + tx + c.rtt_ms / 2e3
                if c.jitter_ms:
                    deliver += self.rng.uniform(0, c.jitter_ms / 1e3)
                if c.loss and self.rng.random() < c.loss:
                    deliver += c.rto_ms / 1e3
                    self.stats.lost_chunks += 1
                deliver = last = max(deliver, last)  # TCP delivers in order
                if direction == "up":
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
                if data:
                    queue.put_nowait((deliver, data))
                if cut_here:
                    queue.put_nowait((deliver, _CUT))
                    return
        except (ConnectionError, asyncio.CancelledError):
            queue.put_nowait(None)

    async def _write(self, conn: _Conn, writer: asyncio.StreamWriter, queue: asyncio.Queue) -> None:
        try:
            while True:
                item = await queue.get()
                if item is None:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                deliver, data = item
                delay = deliver - self._loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if data is _CUT:
                    self._cut_all()
                    then, seconds, connections = self._after_cut
                    if then is not None:
                        self._set_down(then, seconds, connections)
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError, RuntimeError):
            pass


_CUT = object()  # queue marker: reset every connection when this point of the stream is reached


# -- the same proxy in a child process --------------------------------------------------------------
def _child(conn, upstream_port: int, conditions: LinkConditions, seed: int, host: str, listen_port: int) -> None:
    sim = NetSim(upstream_port, conditions, seed, host, listen_port)
    try:
        conn.send(("ok", sim.start()))
    except BaseException as err:  # pragma: no cover - reported to the parent
        conn.send(("error", repr(err)))
        return
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            break
        if method == "stop":
            break
        try:
            conn.send(("ok", getattr(sim, method)(*args)))
        except Exception as err:  # noqa: BLE001 - sent back to the caller
            conn.send(("error", repr(err)))
    sim.stop()


class NetSimProcess:
    """NetSim in a child process, with the same control methods."""

    def __init__(self, upstream_port: int, conditions: LinkConditions | None = None, seed: int = 0,
                 host: str = "127.0.0.1", listen_port: int = 0) -> None:
        _check_loopback(host)
        self._args = (upstream_port, conditions or LinkConditions(), seed, host, listen_port)
        self._conn = None
        self._proc = None
        self.url = ""

    def start(self) -> str:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, *self._args), daemon=True)
        self._proc.start()
        status, value = parent.recv()
        if status != "ok":
            raise RuntimeError(f"netsim child failed to start: {value}")
        self._conn, self.url = parent, value
        return value

    def _rpc(self, method: str, *args):
        self._conn.send((method, args))
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"netsim.{method} failed: {value}")
        return value

    def set_conditions(self, conditions: LinkConditions) -> None:
        self._rpc("set_conditions", conditions)

    def cut(self) -> None:
        self._rpc("cut")

    def set_down(self, mode: str | None, seconds: float | None = None, connections: int | None = None) -> None:
        self._rpc("set_down", mode, seconds, connections)

    def cut_after_bytes(self, n: int, then: str | None = None, seconds: float | None = None,
                        connections: int | None = None) -> None:
        self._rpc("cut_after_bytes", n, then, seconds, connections)

    def disarm(self) -> None:
        self._rpc("disarm")

    def snapshot(self) -> NetStats:
        return self._rpc("snapshot")

    def stop(self) -> None:
        if self._proc is not None:
            try:
                self._conn.send(("stop", ()))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=10)
            if self._proc.is_alive():  # pragma: no cover
                self._proc.terminate()
            self._proc = None

    def __enter__(self) -> NetSimProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

