"""Issue 9, class 1: slow clients never freeze the API.

Uploads read their bodies on the event loop and hand each batch to storage in a
short worker-thread call, so a body that stalls holds no thread. The test opens
more stalled uploads (monolithic PUTs and resumable PATCHes, from raw sockets
that send headers and part of a body) than the worker pool has threads, then
requires reads, token-checked writes and ``/readyz`` to answer within a second;
the stalled bodies must be answered 408 once they have sent nothing for
``CGSTORE_BODY_IDLE_TIMEOUT_S``, leaving no blob, no unfinished write and no
staged byte past the committed offset. Header size and header-read time are
bounded by the server protocol (431 / 408, then closed).
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from cgstore.storage.fs import FileStorage
from tests.blobs.test_blobs_api import digest_of
from tests.support.leftovers import leftover_writes
from tests.support.live_store import CONFIGURATIONS, unique_repo

WORKER_THREADS = 4
STALLED = 3 * WORKER_THREADS
IDLE_TIMEOUT_S = 2.0
DECLARED = 1 << 20  # what each stalled request promises; it sends a hundred bytes of it


def _address(live) -> tuple[str, int]:
    host, port = live.base_url.removeprefix("http://").split(":")
    return host, int(port)


def _stall(live, method: str, path: str, token: str, extra: str = "") -> socket.socket:
    """Send a request's headers and the first hundred bytes of its body, then nothing."""
    sock = socket.create_connection(_address(live))
    sock.sendall(
        (
            f"{method} {path} HTTP/1.1\r\nHost: store\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Length: {DECLARED}\r\n{extra}\r\n"
        ).encode()
        + os.urandom(100)
    )
    return sock


def _read_answer(sock: socket.socket, timeout_s: float) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout_s)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def _error_code(answer: bytes) -> str:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"]


def _staged_bytes(storage, session_id: str) -> int:
    if isinstance(storage, FileStorage):
        return (storage.uploads_dir / session_id).stat().st_size
    listed = storage.client.list_objects_v2(Bucket=storage.bucket, Prefix=storage.key(f"uploads/{session_id}/"))
    return sum(item["Size"] for item in listed.get("Contents", []))


def _timed(call) -> tuple[float, object]:
    started = time.monotonic()
    result = call()
    return time.monotonic() - started, result


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_stalled_uploads_delay_no_other_request_and_are_answered_408(make_store, configuration):
    live = make_store(
        configuration, worker_threads=WORKER_THREADS, body_idle_timeout_s=IDLE_TIMEOUT_S, redirect_downloads=False
    )
    name = unique_repo()
    token = live.mint("alice", f"acme/{name}:read,write")
    base = f"/v1/repos/acme/{name}"
    stored = os.urandom(5000)
    with live.client(token) as client:
        assert client.put(f"{base}/blobs/{digest_of(stored)}", content=stored).status_code == 201
        # Sessions for the stalled chunks, each with a committed first chunk the stall must not disturb.
        sessions = []
        for _ in range(STALLED // 2):
            location = client.post(f"{base}/uploads").headers["location"]
            assert client.patch(location, content=b"c" * 10, headers={"Content-Range": "0-9"}).status_code == 202
            sessions.append(location)

        never_sent = [digest_of(os.urandom(32)) for _ in range(STALLED - len(sessions))]
        stalled = [_stall(live, "PUT", f"{base}/blobs/{digest}", token) for digest in never_sent]
        stalled += [
            _stall(live, "PATCH", location, token, extra=f"Content-Range: 10-{10 + DECLARED - 1}\r\n")
            for location in sessions
        ]
        time.sleep(0.5)  # every stalled request is now inside its handler, waiting for bytes

        fresh = os.urandom(3000)
        checks = {
            "read": lambda: client.get(f"{base}/blobs/{digest_of(stored)}"),
            "head": lambda: client.head(f"{base}/blobs/{digest_of(stored)}"),
            "ranged read": lambda: client.get(f"{base}/blobs/{digest_of(stored)}", headers={"Range": "bytes=0-9"}),
            "token-checked write": lambda: client.put(f"{base}/blobs/{digest_of(fresh)}", content=fresh),
            "missing": lambda: client.post(f"{base}/blobs:missing", json={"digests": [digest_of(fresh)]}),
            "session status": lambda: client.get(sessions[0]),
            "bad token": lambda: client.get(f"{base}/blobs/{digest_of(stored)}", headers={"Authorization": "Bearer x"}),
            "readyz": lambda: client.get("/readyz"),
        }
        for what, call in checks.items():
            elapsed, answer = _timed(call)
            assert elapsed < 1.0, f"{what} took {elapsed:.2f} s behind {STALLED} stalled uploads"
            assert answer.status_code < 500, (what, answer.status_code, answer.text)
        assert client.get("/readyz").json()["status"] == "ok"

        started = time.monotonic()
        answers = [_read_answer(sock, timeout_s=IDLE_TIMEOUT_S + 10) for sock in stalled]
        for sock in stalled:
            sock.close()
        assert time.monotonic() - started < IDLE_TIMEOUT_S + 10
        for answer in answers:
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
            assert _error_code(answer) == "REQUEST_TIMEOUT"

        # Nothing left behind: no blob, no unfinished write, staging exactly at the committed offset.
        for digest in never_sent:
            assert client.head(f"{base}/blobs/{digest}").status_code == 404
            assert live.context.storage.size(digest) is None
        assert not leftover_writes(live.context.storage)
        for location in sessions:
            assert client.get(location).headers["upload-offset"] == "10"
            assert _staged_bytes(live.context.storage, location.rsplit("/", 1)[1]) == 10
            # The session still works: the client resumes at the committed offset.
            assert client.patch(location, content=b"d" * 5, headers={"Content-Range": "10-14"}).status_code == 202
            whole = b"c" * 10 + b"d" * 5
            assert client.put(location, params={"digest": digest_of(whole)}).status_code == 201


def test_a_body_that_trickles_is_not_cut(make_store):
    """The idle timeout is per chunk: a slow but steady body completes."""
    live = make_store("embedded", body_idle_timeout_s=1.0)
    name = unique_repo()
    token = live.mint("alice", f"acme/{name}:read,write")
    data = os.urandom(60)
    sock = socket.create_connection(_address(live))
    sock.sendall(
        (
            f"PUT /v1/repos/acme/{name}/blobs/{digest_of(data)} HTTP/1.1\r\nHost: store\r\n"
            f"Authorization: Bearer {token}\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        ).encode()
    )
    for start in range(0, len(data), 20):  # 3 chunks, 0.6 s apart: 1.2 s in all, never 1 s idle
        time.sleep(0.6)
        sock.sendall(data[start : start + 20])
    assert _read_answer(sock, timeout_s=10).startswith(b"HTTP/1.1 201 ")
    sock.close()


def test_oversized_headers_are_431_and_closed(make_store):
    live = make_store("embedded", max_header_bytes=8192)
    sock = socket.create_connection(_address(live))
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: store\r\nX-Filler: " + b"a" * 20000 + b"\r\n\r\n")
    answer = _read_answer(sock, timeout_s=5)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert _error_code(answer) == "TOO_LARGE"


def test_headers_sent_too_slowly_are_408_and_closed(make_store):
    live = make_store("embedded", header_timeout_s=1.0)
    silent = socket.create_connection(_address(live))  # connects, sends nothing
    slow = socket.create_connection(_address(live))
    started = time.monotonic()
    slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: store\r\n")  # and never the blank line
    for sock in (silent, slow):
        answer = _read_answer(sock, timeout_s=5)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert _error_code(answer) == "REQUEST_TIMEOUT"
    assert time.monotonic() - started < 4


def test_connections_over_the_limit_are_a_json_503(make_store):
    live = make_store("embedded", max_connections=3)
    held = [socket.create_connection(_address(live)) for _ in range(3)]  # connected, sending nothing
    try:
        sock = socket.create_connection(_address(live))
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: store\r\n\r\n")
        answer = _read_answer(sock, timeout_s=5)
        sock.close()
    finally:
        for sock in held:
            sock.close()
    assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
    assert _error_code(answer) == "UNAVAILABLE"
    assert b"\r\nRetry-After: " in answer


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_uploads_declared_past_the_size_limit_are_refused_before_their_body(make_store, configuration):
    """A PUT or PATCH whose declared length passes ``CGSTORE_MAX_BLOB_BYTES`` is answered 413
    at once and the connection closed: its body (never sent past a hundred bytes) is not
    waited for, and nothing is staged."""
    live = make_store(configuration, max_blob_bytes=DECLARED - 1, body_idle_timeout_s=30.0, keep_alive_timeout_s=30.0)
    name = unique_repo()
    token = live.mint("alice", f"acme/{name}:read,write")
    base = f"/v1/repos/acme/{name}"
    with live.client(token) as client:
        location = client.post(f"{base}/uploads").headers["location"]
        assert client.patch(location, content=b"c" * 10, headers={"Content-Range": "0-9"}).status_code == 202
    started = time.monotonic()
    stalled = [
        _stall(live, "PUT", f"{base}/blobs/{digest_of(b'never sent')}", token),
        _stall(live, "PATCH", location, token, extra=f"Content-Range: 10-{10 + DECLARED - 1}\r\n"),
    ]
    for sock in stalled:
        answer = _read_answer(sock, timeout_s=10)  # until the server closes the connection
        sock.close()
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        assert _error_code(answer) == "TOO_LARGE"
    assert time.monotonic() - started < 5  # far below the 30 s idle and keep-alive timeouts
    assert _staged_bytes(live.context.storage, location.rsplit("/", 1)[1]) == 10
    with live.client(token) as client:
        assert client.get(location).headers["upload-offset"] == "10"
        assert client.head(f"{base}/blobs/{digest_of(b'never sent')}").status_code == 404
