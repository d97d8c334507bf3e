"""A network model for benchmarks: a shaping loopback TCP proxy in its own process.

    python bench/netmodel.py --target 127.0.0.1:8080 --c-mib-s 32 --a-mib-s 256 --latency-ms 20
    python bench/netmodel.py        # (as `make bench` runs it) its unshaped forwarding rate, as JSON

prints ``listening <port>`` once it accepts connections, then forwards every
accepted connection to the target until stopped (SIGTERM). Without
``--target`` it measures what it forwards with shaping off and prints
``{"unshaped_mib_s": ...}``. From Python,
:func:`shaped_proxy` runs it as a subprocess for the duration of a block and
:func:`forwarding_capacity` measures what it can forward with shaping off.

What it imitates, each a separate knob:

- **C, a per-connection rate cap** (bytes/s, each direction of each connection
  its own token bucket): the per-TCP-stream throughput limit of object stores
  and CDNs (S3 serves a single GET stream at tens of MiB/s; more comes only
  from more connections).
- **A, an aggregate cap** over all connections (one token bucket per direction,
  shared by every connection): the client's NIC or its share of the link, the
  ceiling no number of connections gets past.
- **L, a first-byte latency per request**: on each connection, when bytes from
  the client arrive after the target last answered (a new request, also on a
  keep-alive connection), the target's next bytes are held until L after that
  request's first byte reached the proxy. Time to first byte is therefore
  ``max(L, target's own time)``: L stands for the request's round trip plus the
  object store's first-byte time. The proxy parses no HTTP; it models one
  request and one response in turn per connection, which is what HTTP/1.1
  without pipelining does. Connection setup costs nothing extra.

Buckets are debt-based: a chunk takes its bytes at once from its connection's
bucket and from the shared one (a balance may go negative) and is sent when
both are back to zero, so concurrent connections are served in the order they
asked and the long-run rates are exact. A bucket refills up
to a burst of 50 ms of its rate (at least one chunk): an idle connection saves
up no more head start than that, and a proxy woken late by a loaded machine can
catch up on that much lateness. (With 10 ms, timers firing late on this busy
2-core VM cost a tenth of the rate or more: curl's median at C = 96 MiB/s went
from 104 to 119 MiB/s with 50 ms, of a 144 the model allows.)

What it does not model: packet loss and retransmission, TCP congestion control
and slow start (a new connection runs at C at once), bufferbloat, TLS
handshakes and encryption cost, DNS, per-host connection limits, asymmetric
up/down links (both directions get the same C and A).

The proxy is one asyncio event loop (uvloop when installed) in one process: it
must not be the bottleneck, which :func:`forwarding_capacity` checks with
shaping off against a trivial byte source.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20
CHUNK = 256 * 1024
BURST_S = 0.05


class TokenBucket:
    """``rate`` bytes/s, debt-based (see the module docstring); ``None`` rate means unlimited."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.burst = max(CHUNK, (rate or 0) * BURST_S)
        self.tokens = self.burst
        self.stamp = asyncio.get_running_loop().time()

    def take(self, n: int, now: float) -> float:
        """Take ``n`` bytes; the seconds to wait before sending them."""
        if self.rate is None:
            return 0.0
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate) - n
        self.stamp = now
        return max(0.0, -self.tokens / self.rate)


@dataclass
class Shape:
    """The model's knobs: rates in bytes/s (``None`` = unlimited), latency in seconds."""

    per_connection: float | None = None
    aggregate: float | None = None
    latency_s: float = 0.0


class _Half(asyncio.Protocol):
    """One socket of a proxied connection: what it receives goes to ``peer``, shaped.

    Protocols rather than streams: data goes from one transport to the other
    without a reader's buffer in between (streams cost the proxy half its speed).
    A chunk that must wait is held with this socket's reading paused, so chunks
    never overtake each other; a full write buffer on the peer pauses it too.
    """

    def __init__(self, connection: _Connection, own: TokenBucket, shared: TokenBucket, is_request_side: bool) -> None:
        self.connection = connection
        self.own = own
        self.shared = shared
        self.is_request_side = is_request_side
        self.transport: asyncio.Transport | None = None
        self.peer: _Half | None = None
        self.pauses = 0
        self.held: collections.deque[tuple[float, bytes]] = collections.deque()  # (send time, chunk), in order
        self.eof = False
        self.lost = False
        self.early: list[bytes] = []  # received before the target connection was made

    # -- reading paused for any number of reasons at once -----------------------------------
    def pause(self) -> None:
        self.pauses += 1
        if self.pauses == 1 and not self.lost:
            self.transport.pause_reading()

    def resume(self) -> None:
        self.pauses -= 1
        if self.pauses == 0 and not self.lost:
            self.transport.resume_reading()

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.is_request_side:
            self.pause()  # until the target is there to take the bytes
            asyncio.get_running_loop().create_task(self.connection.open_target())
        else:
            self.connection.target_ready()

    def data_received(self, data: bytes) -> None:
        if self.peer.transport is None:  # pausing in connection_made does not stop a first read
            self.early.append(data)
            return
        now = asyncio.get_running_loop().time()
        delay = self.connection.delay(self, len(data), now)
        if delay <= 0 and not self.held:
            self.peer.transport.write(data)
            return
        # Held chunks leave in order, none due before the one ahead of it (reading may
        # deliver once more after a pause).
        send_at = max(now + delay, self.held[-1][0] if self.held else now)
        self.held.append((send_at, data))
        if len(self.held) == 1:
            self.pause()
            asyncio.get_running_loop().call_at(send_at, self._release)

    def _release(self) -> None:
        loop = asyncio.get_running_loop()
        while self.held and self.held[0][0] <= loop.time():
            _, data = self.held.popleft()
            if not self.peer.lost:
                self.peer.transport.write(data)
        if self.held:
            loop.call_at(self.held[0][0], self._release)
            return
        self.resume()
        self._forward_end()

    def eof_received(self) -> bool:
        self.eof = True
        self._forward_end()
        return True  # half-close: the other direction keeps flowing

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.eof = True
        self._forward_end()

    def pause_writing(self) -> None:
        self.peer.pause()

    def resume_writing(self) -> None:
        self.peer.resume()

    def _forward_end(self) -> None:
        """Once everything this side sent is forwarded: pass its EOF on; close when both ended."""
        peer = self.peer
        if not self.eof or self.held or (peer.transport is None and not self.lost):
            return
        if self.lost or peer.eof or peer.transport is None:
            self.connection.close()
        elif not peer.lost and peer.transport.can_write_eof():
            peer.transport.write_eof()


class _Connection:
    """One accepted connection and its connection to the target; the request/response turns."""

    def __init__(self, proxy: Proxy) -> None:
        shape = proxy.shape
        self.target_address = proxy.target
        self.latency_s = shape.latency_s
        self.request_at: float | None = None  # first byte of a request not answered yet
        self.client = _Half(self, TokenBucket(shape.per_connection), proxy.up, is_request_side=True)
        self.target = _Half(self, TokenBucket(shape.per_connection), proxy.down, is_request_side=False)
        self.client.peer, self.target.peer = self.target, self.client

    def delay(self, half: _Half, n: int, now: float) -> float:
        wait = max(half.own.take(n, now), half.shared.take(n, now))
        if half.is_request_side:
            if self.request_at is None:
                self.request_at = now
        elif self.request_at is not None:
            wait = max(wait, self.request_at + self.latency_s - now)
            self.request_at = None
        return wait

    async def open_target(self) -> None:
        try:
            await asyncio.get_running_loop().create_connection(lambda: self.target, *self.target_address)
        except OSError:
            self.client.transport.close()

    def target_ready(self) -> None:
        """The target is connected: what the client sent meanwhile goes first, then reading resumes."""
        early, self.client.early = self.client.early, []
        for data in early:
            self.client.data_received(data)
        self.client.resume()
        self.client._forward_end()

    def close(self) -> None:
        for half in (self.client, self.target):
            if half.transport is not None:
                half.transport.close()  # flushes what is buffered first


class Proxy:
    def __init__(self, target: tuple[str, int], shape: Shape) -> None:
        self.target = target
        self.shape = shape
        self.up = TokenBucket(shape.aggregate)  # client -> target, all connections
        self.down = TokenBucket(shape.aggregate)  # target -> client, all connections

    def accept(self) -> _Half:
        return _Connection(self).client


async def _serve(target: tuple[str, int], shape: Shape, port: int) -> None:
    proxy = Proxy(target, shape)
    server = await asyncio.get_running_loop().create_server(proxy.accept, "127.0.0.1", port, backlog=256)
    print(f"listening {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def _run(target: tuple[str, int], shape: Shape, port: int) -> None:
    try:
        import uvloop

        uvloop.run(_serve(target, shape, port))
    except ImportError:
        asyncio.run(_serve(target, shape, port))


# -- running it from a bench --------------------------------------------------------------------


@dataclass
class RunningProxy:
    port: int
    process: subprocess.Popen

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}"


@contextlib.contextmanager
def shaped_proxy(target_host: str, target_port: int, shape: Shape) -> Iterator[RunningProxy]:
    """Run the proxy in its own process for the block; stop it (SIGTERM) after."""
    args = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--target",
        f"{target_host}:{target_port}",
        "--latency-ms",
        str(shape.latency_s * 1000),
    ]
    if shape.per_connection is not None:
        args += ["--c-mib-s", str(shape.per_connection / MiB)]
    if shape.aggregate is not None:
        args += ["--a-mib-s", str(shape.aggregate / MiB)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("listening "):
            raise RuntimeError(f"the proxy did not start (said {line!r}, exit {proc.poll()})")
        yield RunningProxy(port=int(line.split()[1]), process=proc)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@contextlib.contextmanager
def _byte_source(total: int) -> Iterator[int]:
    """A loopback server (a thread) that sends ``total`` zero bytes to each connection, then closes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    stop = threading.Event()

    def serve() -> None:
        block = bytes(4 * MiB)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                left = total
                with contextlib.suppress(OSError):
                    while left > 0:
                        left -= conn.send(memoryview(block)[: min(left, len(block))])

    thread = threading.Thread(target=serve, name="byte-source", daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not
        listener.close()
        thread.join(5)


def read_all(port: int) -> int:
    """Connect to ``port`` on loopback and read until EOF; the number of bytes."""
    got = 0
    buffer = bytearray(4 * MiB)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        while n := conn.recv_into(buffer):
            got += n
    return got


def forwarding_capacity(total: int = 1024 * MiB, streams: int = 3) -> float:
    """Bytes/s the proxy forwards with shaping off: ``streams`` connections reading ``total`` bytes in all."""
    each = total // streams
    with _byte_source(each) as source_port, shaped_proxy("127.0.0.1", source_port, Shape()) as proxy:
        started = time.perf_counter()
        threads = [threading.Thread(target=read_all, args=(proxy.port,)) for _ in range(streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return each * streams / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="host:port to forward to (without: measure the unshaped rate)")
    parser.add_argument("--port", type=int, default=0, help="listen port (default: a free one, printed)")
    parser.add_argument("--c-mib-s", type=float, default=None, help="per-connection cap, MiB/s (default: none)")
    parser.add_argument("--a-mib-s", type=float, default=None, help="aggregate cap, MiB/s (default: none)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="first-byte latency per request (default 0)")
    args = parser.parse_args()
    if args.target is None:
        print(json.dumps({"unshaped_mib_s": round(forwarding_capacity() / MiB, 1)}), flush=True)
        return
    host, _, port = args.target.rpartition(":")
    shape = Shape(
        per_connection=None if args.c_mib_s is None else args.c_mib_s * MiB,
        aggregate=None if args.a_mib_s is None else args.a_mib_s * MiB,
        latency_s=args.latency_ms / 1000,
    )
    with contextlib.suppress(KeyboardInterrupt):
        _run((host, int(port)), shape, args.port)


if __name__ == "__main__":
    main()
