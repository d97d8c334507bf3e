"""bench/netmodel.py, the shaping proxy of the network benchmark: bytes intact, clean close.

The proxy is a benchmark tool, but a proxy that corrupts, truncates or hangs
would make the benchmark's figures meaningless, so its plumbing is tested here.
Only one coarse timing check (a cap must slow a transfer down at all); no
figure is asserted.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import socket
import sys
import threading
import time

import pytest

from tests.support.services import REPO_ROOT

MiB = 1 << 20


def _load_netmodel():
    spec = importlib.util.spec_from_file_location("netmodel", REPO_ROOT / "bench" / "netmodel.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("netmodel", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


netmodel = _load_netmodel()


class EchoHasher:
    """A loopback server: reads a request until the client half-closes, answers its SHA-256 and
    ``reply`` bytes, then closes. Records what it saw."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.port = self.listener.getsockname()[1]
        self.received: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                data = bytearray()
                while chunk := conn.recv(MiB):
                    data += chunk
                self.received.append(bytes(data))
                conn.sendall(hashlib.sha256(data).digest() + self.reply)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not
        self.listener.close()
        self.thread.join(5)


@pytest.fixture
def server():
    reply = os.urandom(3 * MiB + 17)
    echo = EchoHasher(reply)
    yield echo
    echo.close()


def exchange(port: int, request: bytes) -> bytes:
    """Send ``request``, half-close, read the answer until the proxy closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(request)
        conn.shutdown(socket.SHUT_WR)
        answer = bytearray()
        while chunk := conn.recv(MiB):
            answer += chunk
    return bytes(answer)


def test_bytes_cross_intact_both_ways_and_connections_close(server):
    shape = netmodel.Shape(per_connection=64 * MiB, aggregate=128 * MiB, latency_s=0.005)
    with netmodel.shaped_proxy("127.0.0.1", server.port, shape) as proxy:
        requests = [os.urandom(2 * MiB + i) for i in range(3)]
        answers: dict[int, bytes] = {}
        threads = [
            threading.Thread(target=lambda i=i: answers.__setitem__(i, exchange(proxy.port, requests[i])))
            for i in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert proxy.process.poll() is None  # still serving after the connections ended
    for i, request in enumerate(requests):
        # The answer ends (EOF reached, so the proxy closed) with exactly what the server sent.
        assert answers[i] == hashlib.sha256(request).digest() + server.reply
    assert sorted(server.received, key=len) == requests
    assert proxy.process.returncode is not None  # stopped with the block


def test_a_per_connection_cap_slows_a_transfer_down(server):
    shape = netmodel.Shape(per_connection=8 * MiB)
    with netmodel.shaped_proxy("127.0.0.1", server.port, shape) as proxy:
        started = time.monotonic()
        answer = exchange(proxy.port, os.urandom(MiB))
        elapsed = time.monotonic() - started
    # 1 MiB up and 3 MiB down at 8 MiB/s each way: about 0.5 s; any cap at all gives >= 0.3 s.
    assert len(answer) == 32 + len(server.reply)
    assert elapsed >= 0.3


def test_a_target_that_refuses_closes_the_client():
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]  # nothing listens once this closes
    with netmodel.shaped_proxy("127.0.0.1", port, netmodel.Shape()) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as conn:
            assert conn.recv(1024) == b""  # closed (EOF), not left hanging
        assert proxy.process.poll() is None
