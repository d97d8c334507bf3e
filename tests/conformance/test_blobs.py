"""Conformance: the blob protocol (docs/protocol.md "Blobs"), every upload path and its bad variants."""

from __future__ import annotations

import json
import socket

import blake3
import httpx
import pytest

from tests.conformance.conftest import unique


def digest_of(data: bytes) -> str:
    return f"blake3:{blake3.blake3(data).hexdigest()}"


@pytest.fixture
def repo(deployment):
    owner = unique("conf")
    token = deployment.mint(f"{owner}-writer", f"{owner}/*:read,write")
    with deployment.client(token) as client:
        yield client, f"/v1/repos/{owner}/blobs"


def _fetch(client, url: str, headers: dict | None = None):
    """GET a blob, following a redirect to storage without sending our token there."""
    answer = client.get(url, headers=headers)
    if answer.status_code == 307:
        answer = httpx.get(answer.headers["Location"], headers=headers, timeout=60)
    return answer


def _unsatisfiable(answer) -> None:
    """416, with the protocol's body when the store answered (storage speaks its own)."""
    assert answer.status_code == 416, answer.text
    if answer.headers.get("content-type", "").startswith("application/json"):
        assert answer.json()["error"]["code"] == "RANGE_INVALID"


def _error(answer, status: int, code: str) -> None:
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == code


def test_monolithic_upload_then_head_and_get(repo):
    client, base = repo
    data = b"conformance monolithic" * 100
    put = client.put(f"{base}/blobs/{digest_of(data)}", content=data)
    assert put.status_code == 201, put.text
    head = client.head(f"{base}/blobs/{digest_of(data)}")
    assert head.status_code == 200
    assert head.headers["Content-Length"] == str(len(data))
    assert head.headers["ETag"] == f'"{digest_of(data)}"'
    assert _fetch(client, f"{base}/blobs/{digest_of(data)}").content == data


def test_wrong_digest_and_wrong_size_are_refused_and_nothing_is_visible(repo):
    client, base = repo
    data, other = b"the bytes sent", b"the bytes named"
    _error(client.put(f"{base}/blobs/{digest_of(other)}", content=data), 400, "DIGEST_INVALID")
    assert client.head(f"{base}/blobs/{digest_of(other)}").status_code == 404
    assert client.head(f"{base}/blobs/{digest_of(data)}").status_code == 404
    answer = _put_short_body(client.base_url, f"{base}/blobs/{digest_of(data)}", client, data)
    # A body cut short ends the request: the store answers SIZE_INVALID or just drops it.
    if answer is not None:
        assert answer[0] == 400 and json.loads(answer[1])["error"]["code"] == "SIZE_INVALID"
    assert client.head(f"{base}/blobs/{digest_of(data)}").status_code == 404


def _put_short_body(url: httpx.URL, path: str, client, data: bytes) -> tuple[int, str] | None:
    """PUT declaring 5 more bytes than it sends, then half-close: a truncated upload.

    httpx refuses to send a body shorter than its Content-Length, so this speaks HTTP/1.1 itself.
    """
    head = (
        f"PUT {path} HTTP/1.1\r\nHost: {url.host}\r\nAuthorization: {client.headers['Authorization']}\r\n"
        f"Content-Length: {len(data) + 5}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection((url.host, url.port or 80), timeout=30) as sock:
        sock.sendall(head.encode() + data)
        sock.shutdown(socket.SHUT_WR)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    if not raw:
        return None
    status_line, _, rest = raw.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2].decode(errors="replace")


def test_the_empty_blob(repo):
    client, base = repo
    empty = digest_of(b"")
    assert client.put(f"{base}/blobs/{empty}", content=b"").status_code == 201
    assert client.head(f"{base}/blobs/{empty}").headers["Content-Length"] == "0"
    assert _fetch(client, f"{base}/blobs/{empty}").content == b""
    _unsatisfiable(_fetch(client, f"{base}/blobs/{empty}", headers={"Range": "bytes=0-0"}))


def test_chunked_upload_resumes_from_the_servers_offset(repo):
    client, base = repo
    data = bytes(range(256)) * 64
    location = client.post(f"{base}/uploads").headers["Location"]
    first = client.patch(location, content=data[:4096], headers={"Content-Range": "0-4095"})
    assert first.status_code == 202 and first.headers["Range"] == "0-4095"
    # A client that lost track asks where to continue.
    status = client.get(location)
    assert status.status_code == 204 and status.headers["Range"] == "0-4095"
    _error(client.patch(location, content=data[:4096], headers={"Content-Range": "0-4095"}), 416, "RANGE_INVALID")
    assert (
        client.patch(location, content=data[4096:], headers={"Content-Range": f"4096-{len(data) - 1}"}).status_code
        == 202
    )
    assert client.put(location, params={"digest": digest_of(data)}).status_code == 201
    assert _fetch(client, f"{base}/blobs/{digest_of(data)}").content == data


def test_a_chunked_upload_with_the_wrong_digest_is_consumed_and_leaves_nothing(repo):
    client, base = repo
    data = b"chunked bytes" * 50
    location = client.post(f"{base}/uploads").headers["Location"]
    assert client.patch(location, content=data, headers={"Content-Range": f"0-{len(data) - 1}"}).status_code == 202
    _error(client.put(location, params={"digest": digest_of(b"other")}), 400, "DIGEST_INVALID")
    assert client.head(f"{base}/blobs/{digest_of(data)}").status_code == 404
    _error(client.get(location), 404, "BLOB_UPLOAD_UNKNOWN")


def test_cancel_forgets_the_session(repo):
    client, base = repo
    location = client.post(f"{base}/uploads").headers["Location"]
    assert client.patch(location, content=b"abc", headers={"Content-Range": "0-2"}).status_code == 202
    assert client.delete(location).status_code == 204
    _error(client.get(location), 404, "BLOB_UPLOAD_UNKNOWN")
    _error(client.put(location, params={"digest": digest_of(b"abc")}), 404, "BLOB_UPLOAD_UNKNOWN")


@pytest.mark.parametrize(
    ("header", "expected"),
    [("bytes=0-3", b"0123"), ("bytes=6-", b"6789"), ("bytes=-2", b"89"), ("bytes=8-100", b"89")],
)
def test_ranges(repo, header, expected):
    client, base = repo
    data = b"0123456789"
    client.put(f"{base}/blobs/{digest_of(data)}", content=data)
    answer = _fetch(client, f"{base}/blobs/{digest_of(data)}", headers={"Range": header})
    assert answer.status_code == 206, answer.text
    assert answer.content == expected


def test_unsatisfiable_range(repo):
    client, base = repo
    data = b"0123456789"
    client.put(f"{base}/blobs/{digest_of(data)}", content=data)
    _unsatisfiable(_fetch(client, f"{base}/blobs/{digest_of(data)}", headers={"Range": "bytes=10-"}))


def test_redirects_never_carry_the_token(deployment, repo):
    client, base = repo
    data = b"redirected bytes"
    client.put(f"{base}/blobs/{digest_of(data)}", content=data)
    answer = client.get(f"{base}/blobs/{digest_of(data)}")
    if answer.status_code == 200:
        assert answer.content == data  # this deployment streams itself
        return
    assert answer.status_code == 307
    location = answer.headers["Location"]
    assert not any(location.startswith(url) for url in deployment.urls)  # storage, not the API
    assert "Authorization" not in answer.headers


def test_mount_needs_read_on_the_source(deployment, repo):
    client, base = repo
    data = b"mounted bytes"
    client.put(f"{base}/blobs/{digest_of(data)}", content=data)
    owner = base.split("/")[3]
    mounted = client.post(
        f"/v1/repos/{owner}/elsewhere/blobs/{digest_of(data)}:mount", params={"from": f"{owner}/blobs"}
    )
    assert mounted.status_code == 201, mounted.text
    assert _fetch(client, f"/v1/repos/{owner}/elsewhere/blobs/{digest_of(data)}").content == data
    stranger = unique("conf")
    token = deployment.mint(f"{stranger}-writer", f"{stranger}/*:read,write")
    with deployment.client(token) as other:
        refused = other.post(f"/v1/repos/{stranger}/x/blobs/{digest_of(data)}:mount", params={"from": f"{owner}/blobs"})
        _error(refused, 404, "BLOB_UNKNOWN")


def test_missing_names_only_unlinked_digests(repo):
    client, base = repo
    data = b"present"
    client.put(f"{base}/blobs/{digest_of(data)}", content=data)
    absent = digest_of(b"absent")
    answer = client.post(f"{base}/blobs:missing", json={"digests": [digest_of(data), absent]})
    assert answer.status_code == 200 and answer.json()["missing"] == [absent]


def test_knowing_a_digest_grants_nothing(deployment, repo):
    client, base = repo
    data = b"a secret of one tenant"
    client.put(f"{base}/blobs/{digest_of(data)}", content=data)
    stranger = unique("conf")
    token = deployment.mint(f"{stranger}-reader", f"{stranger}/*:read,write")
    with deployment.client(token) as other:
        _error(other.get(f"{base}/blobs/{digest_of(data)}"), 404, "BLOB_UNKNOWN")
        absent = other.get(f"{base}/blobs/{digest_of(b'never stored')}")
        _error(absent, 404, "BLOB_UNKNOWN")
