"""``CGSTORE_MAX_BLOB_BYTES`` at its boundary, on both configurations, on every upload path.

A blob of exactly the limit is accepted, one byte more is 413 ``TOO_LARGE``:
monolithic PUT (declared or chunked body) and session (declared chunks, the
commit's own body). A session chunk under the limit alone but over it with its
offset is refused from its headers, before any byte of its body is read.
"""

from __future__ import annotations

import os
import socket

import blake3
import pytest

from tests.support.leftovers import staged_session_bytes
from tests.support.live_store import CONFIGURATIONS, unique_repo

LIMIT = 4096


def digest_of(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def error_code(answer) -> str:
    return answer.json()["error"]["code"]


def pieces(data: bytes, size: int = 1000):
    """A body without Content-Length (chunked transfer): only the bytes themselves can pass the limit."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


@pytest.fixture(params=CONFIGURATIONS)
def limited(request, make_store):
    """(store with a LIMIT-byte blob limit, repo name, token)."""
    live = make_store(request.param, max_blob_bytes=LIMIT)
    name = unique_repo()
    return live, name, live.mint("alice", f"acme/{name}:read,write")


def test_monolithic_put_accepts_exactly_the_limit_and_refuses_one_byte_more(limited):
    live, name, token = limited
    with live.client(token) as client:
        for declared in (True, False):
            exact, over = os.urandom(LIMIT), os.urandom(LIMIT + 1)
            body = (lambda data: data) if declared else (lambda data: pieces(data))
            ok = client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(exact)}", content=body(exact))
            assert ok.status_code == 201, (declared, ok.text)
            refused = client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(over)}", content=body(over))
            assert refused.status_code == 413 and error_code(refused) == "TOO_LARGE", (declared, refused.text)
            assert client.head(f"/v1/repos/acme/{name}/blobs/{digest_of(over)}").status_code == 404


def _session(client, name: str) -> str:
    return client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]


def test_session_accepts_exactly_the_limit_and_refuses_one_byte_more(limited):
    live, name, token = limited
    exact, over = os.urandom(LIMIT), os.urandom(LIMIT + 1)
    with live.client(token) as client:
        # Declared chunks up to exactly the limit, then a commit: accepted.
        location = _session(client, name)
        assert client.patch(location, content=exact[:1000], headers={"Content-Range": "0-999"}).status_code == 202
        last = client.patch(location, content=exact[1000:], headers={"Content-Range": f"1000-{LIMIT - 1}"})
        assert last.status_code == 202 and last.headers["upload-offset"] == str(LIMIT)
        committed = client.put(location, params={"digest": digest_of(exact)})
        assert committed.status_code == 201, committed.text
        # The last byte of the limit in the commit's own body: accepted too.
        location = _session(client, name)
        other = os.urandom(LIMIT)
        assert (
            client.patch(location, content=other[:-1], headers={"Content-Range": f"0-{LIMIT - 2}"}).status_code == 202
        )
        assert client.put(location, params={"digest": digest_of(other)}, content=pieces(other[-1:])).status_code == 201
        # One byte more, declared by a chunk: 413, and the session keeps its offset.
        location = _session(client, name)
        assert (
            client.patch(location, content=over[:LIMIT], headers={"Content-Range": f"0-{LIMIT - 1}"}).status_code == 202
        )
        refused = client.patch(location, content=over[LIMIT:], headers={"Content-Range": f"{LIMIT}-{LIMIT}"})
        assert refused.status_code == 413 and error_code(refused) == "TOO_LARGE", refused.text
        assert client.get(location).headers["upload-offset"] == str(LIMIT)
        # One byte more in the commit's body (no declared length): 413.
        refused = client.put(location, params={"digest": digest_of(over)}, content=pieces(over[LIMIT:]))
        assert refused.status_code == 413 and error_code(refused) == "TOO_LARGE", refused.text
        assert client.head(f"/v1/repos/acme/{name}/blobs/{digest_of(over)}").status_code == 404


def _headers_only(live, path: str, headers: dict[str, str]) -> bytes:
    """Send a PATCH's request line and headers, none of its body; return what the store answers."""
    host, port = live.base_url.removeprefix("http://").rsplit(":", 1)
    head = f"PATCH {path} HTTP/1.1\r\nHost: {host}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(head.encode() + b"\r\n")
        try:
            conn.recv(1, socket.MSG_PEEK)
        except TimeoutError:
            return b"no answer in 10 s: the store waits for the body"
        answer = conn.makefile("rb")
        status = answer.readline()
        length = 0
        while (line := answer.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status + answer.read(length)


def test_a_chunk_over_the_limit_only_with_its_offset_is_refused_before_its_body(limited):
    live, name, token = limited
    with live.client(token) as client:
        location = _session(client, name)
        assert client.patch(location, content=os.urandom(1000), headers={"Content-Range": "0-999"}).status_code == 202
    session_id = location.rsplit("/", 1)[1]
    length = LIMIT - 500  # under the limit alone; 1000 + length passes it
    answer = _headers_only(
        live,
        location,
        {
            "Authorization": f"Bearer {token}",
            "Content-Range": f"1000-{1000 + length - 1}",
            "Content-Length": str(length),
            "Content-Type": "application/octet-stream",
        },
    )
    # Answered with none of the body sent: nothing of it was waited for, let alone read.
    assert answer.startswith(b"HTTP/1.1 413 ") and b'"TOO_LARGE"' in answer, answer[:300]
    with live.client(token) as client:
        assert client.get(location).headers["upload-offset"] == "1000"
    assert staged_session_bytes(live.context.storage, session_id) == 1000
