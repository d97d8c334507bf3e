"""The Blobs section of docs/protocol.md, over HTTP, against both configurations."""

from __future__ import annotations

import os
import threading
from itertools import pairwise

import blake3
import httpx
import pytest

from tests.support.live_store import unique_repo


def digest_of(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


@pytest.fixture
def repo(store):
    """A fresh repo name under owner ``acme``, and a read/write token for it."""
    name = unique_repo()
    token = store.mint("alice", f"acme/{name}:read,write")
    return name, token


def error_code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


def assert_not_visible(store, token: str, name: str, digest: str) -> None:
    with store.client(token) as client:
        assert client.head(f"/v1/repos/acme/{name}/blobs/{digest}").status_code == 404
        assert client.get(f"/v1/repos/acme/{name}/blobs/{digest}").status_code == 404
    assert store.context.storage.size(digest) is None


def test_monolithic_put_then_head_and_get_byte_identical(store, repo):
    name, token = repo
    data = os.urandom(3 * 1024 * 1024 + 17)
    digest = digest_of(data)
    with store.client(token, follow_redirects=True) as client:
        put = client.put(f"/v1/repos/acme/{name}/blobs/{digest}", content=data)
        assert put.status_code == 201, put.text
        head = client.head(f"/v1/repos/acme/{name}/blobs/{digest}")
        assert head.status_code == 200
        assert head.headers["content-length"] == str(len(data))
        assert head.headers["etag"] == f'"{digest}"'
        got = client.get(f"/v1/repos/acme/{name}/blobs/{digest}")
        assert got.status_code == 200
        assert got.content == data


def test_get_redirects_to_presigned_url_on_s3_and_streams_on_fs(store, repo):
    name, token = repo
    data = b"redirect me" * 100
    digest = digest_of(data)
    with store.client(token) as client:
        assert client.put(f"/v1/repos/acme/{name}/blobs/{digest}", content=data).status_code == 201
        got = client.get(f"/v1/repos/acme/{name}/blobs/{digest}")
    if store.is_s3:
        assert got.status_code == 307
        direct = httpx.get(got.headers["location"])
        assert direct.status_code == 200 and direct.content == data
    else:
        assert got.status_code == 200 and got.content == data


def test_ranged_get(store, make_store, repo):
    target = store if not store.is_s3 else make_store(store.configuration, redirect_downloads=False)
    name = unique_repo()
    token = target.mint("alice", f"acme/{name}:read,write")
    data = bytes(range(256)) * 64
    digest = digest_of(data)
    with target.client(token) as client:
        assert client.put(f"/v1/repos/acme/{name}/blobs/{digest}", content=data).status_code == 201
        url = f"/v1/repos/acme/{name}/blobs/{digest}"
        middle = client.get(url, headers={"Range": "bytes=100-199"})
        assert middle.status_code == 206
        assert middle.content == data[100:200]
        assert middle.headers["content-range"] == f"bytes 100-199/{len(data)}"
        assert client.get(url, headers={"Range": "bytes=-10"}).content == data[-10:]
        assert client.get(url, headers={"Range": "bytes=16000-"}).content == data[16000:]
        unsatisfiable = client.get(url, headers={"Range": f"bytes={len(data)}-"})
        assert unsatisfiable.status_code == 416 and error_code(unsatisfiable) == "RANGE_INVALID"


def test_wrong_digest_is_refused_and_nothing_visible(store, repo):
    name, token = repo
    data = os.urandom(100_000)
    claimed = digest_of(b"something else")
    with store.client(token) as client:
        put = client.put(f"/v1/repos/acme/{name}/blobs/{claimed}", content=data)
    assert put.status_code == 400 and error_code(put) == "DIGEST_INVALID"
    assert_not_visible(store, token, name, claimed)
    assert store.context.storage.size(digest_of(data)) is None


def test_malformed_digest_is_digest_invalid(store, repo):
    name, token = repo
    with store.client(token) as client:
        for bad in ["sha256:" + "0" * 64, "blake3:" + "A" * 64, "blake3:abc"]:
            put = client.put(f"/v1/repos/acme/{name}/blobs/{bad}", content=b"x")
            assert put.status_code == 400 and error_code(put) == "DIGEST_INVALID", bad


def test_chunked_upload_resume_and_commit(store, repo):
    name, token = repo
    data = os.urandom(2 * 1024 * 1024 + 333)
    digest = digest_of(data)
    cuts = [0, 700_000, 1_500_000, len(data)]
    with store.client(token) as client:
        opened = client.post(f"/v1/repos/acme/{name}/uploads")
        assert opened.status_code == 202
        location = opened.headers["location"]
        assert location.startswith(f"/v1/repos/acme/{name}/uploads/")
        for start, end in pairwise(cuts):
            patch = client.patch(location, content=data[start:end], headers={"Content-Range": f"{start}-{end - 1}"})
            assert patch.status_code == 202, patch.text
            assert patch.headers["range"] == f"0-{end - 1}"
            status = client.get(location)
            assert status.status_code == 204 and status.headers["upload-offset"] == str(end)
        assert_not_visible(store, token, name, digest)  # nothing visible before the commit
        commit = client.put(location, params={"digest": digest})
        assert commit.status_code == 201, commit.text
        got = client.get(f"/v1/repos/acme/{name}/blobs/{digest}", follow_redirects=True)
        assert got.content == data
        assert client.get(location).status_code == 404  # the session is consumed


def test_out_of_order_chunk_is_416(store, repo):
    name, token = repo
    with store.client(token) as client:
        location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
        assert client.patch(location, content=b"a" * 10, headers={"Content-Range": "0-9"}).status_code == 202
        skipped = client.patch(location, content=b"b" * 10, headers={"Content-Range": "20-29"})
        assert skipped.status_code == 416 and error_code(skipped) == "RANGE_INVALID"
        replayed = client.patch(location, content=b"c" * 10, headers={"Content-Range": "0-9"})
        assert replayed.status_code == 416
        assert client.get(location).headers["upload-offset"] == "10"


def test_chunk_shorter_than_its_content_range_is_size_invalid(store, repo):
    name, token = repo
    with store.client(token) as client:
        location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
        short = client.patch(location, content=b"a" * 50, headers={"Content-Range": "0-99"})
        assert short.status_code == 400 and error_code(short) == "SIZE_INVALID"
        assert client.get(location).headers["upload-offset"] == "0"


def test_commit_with_wrong_digest_leaves_nothing(store, repo):
    name, token = repo
    data = os.urandom(50_000)
    wrong = digest_of(b"not these bytes")
    with store.client(token) as client:
        location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
        client.patch(location, content=data, headers={"Content-Range": f"0-{len(data) - 1}"})
        commit = client.put(location, params={"digest": wrong})
        assert commit.status_code == 400 and error_code(commit) == "DIGEST_INVALID"
    assert_not_visible(store, token, name, wrong)
    assert store.context.storage.size(digest_of(data)) is None


def test_unknown_upload_session(store, repo):
    name, token = repo
    with store.client(token) as client:
        for method in ("GET", "PATCH", "PUT", "DELETE"):
            response = client.request(
                method, f"/v1/repos/acme/{name}/uploads/0123456789abcdef", params={"digest": digest_of(b"")}
            )
            assert response.status_code == 404 and error_code(response) == "BLOB_UPLOAD_UNKNOWN", method


def test_cancelled_session_is_gone(store, repo):
    name, token = repo
    with store.client(token) as client:
        location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
        client.patch(location, content=b"x" * 1000, headers={"Content-Range": "0-999"})
        assert client.delete(location).status_code == 204
        assert client.get(location).status_code == 404


def test_another_principals_session_is_unknown(store, repo):
    name, token = repo
    other = store.mint("mallory", f"acme/{name}:read,write")
    with store.client(token) as client:
        location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
    with store.client(other) as client:
        assert client.get(location).status_code == 404


def test_missing_check(store, repo):
    name, token = repo
    present = b"present"
    with store.client(token) as client:
        client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(present)}", content=present)
        absent = digest_of(b"absent")
        answer = client.post(
            f"/v1/repos/acme/{name}/blobs:missing", json={"digests": [digest_of(present), absent, absent]}
        )
        assert answer.status_code == 200
        assert answer.json() == {"missing": [absent]}


def test_missing_check_refuses_huge_json(store, repo):
    name, token = repo
    huge = b'{"digests": ["' + b"a" * (2 * 1024 * 1024) + b'"]}'
    with store.client(token) as client:
        answer = client.post(
            f"/v1/repos/acme/{name}/blobs:missing", content=huge, headers={"Content-Type": "application/json"}
        )
    assert answer.status_code == 413 and error_code(answer) == "TOO_LARGE"


def test_blob_stored_once_and_knowing_a_digest_grants_nothing(store, repo):
    name, token = repo
    data = os.urandom(10_000)
    digest = digest_of(data)
    other_repo = unique_repo()
    other = store.mint("bob", f"acme/{other_repo}:read,write")
    with store.client(token) as client:
        assert client.put(f"/v1/repos/acme/{name}/blobs/{digest}", content=data).status_code == 201
    with store.client(other) as client:
        # Bob's repo does not have it, though the store does.
        assert client.head(f"/v1/repos/acme/{other_repo}/blobs/{digest}").status_code == 404
        assert client.post(f"/v1/repos/acme/{other_repo}/blobs:missing", json={"digests": [digest]}).json() == {
            "missing": [digest]
        }
        # Mounting from a repo Bob cannot read answers like a missing blob.
        mount = client.post(f"/v1/repos/acme/{other_repo}/blobs/{digest}:mount", params={"from": f"acme/{name}"})
        assert mount.status_code == 404 and error_code(mount) == "BLOB_UNKNOWN"
        # Sending the bytes links it (and they are verified, though already stored).
        assert client.put(f"/v1/repos/acme/{other_repo}/blobs/{digest}", content=data).status_code == 201
        assert client.head(f"/v1/repos/acme/{other_repo}/blobs/{digest}").status_code == 200
        wrong = client.put(f"/v1/repos/acme/{other_repo}/blobs/{digest}", content=data + b"!")
        assert wrong.status_code == 400 and error_code(wrong) == "DIGEST_INVALID"


def test_mount_from_readable_repo(store, repo):
    name, token = repo
    data = os.urandom(5_000)
    digest = digest_of(data)
    target = unique_repo()
    both = store.mint("carol", f"acme/{name}:read", f"acme/{target}:read,write")
    with store.client(token) as client:
        client.put(f"/v1/repos/acme/{name}/blobs/{digest}", content=data)
    with store.client(both, follow_redirects=True) as client:
        mount = client.post(f"/v1/repos/acme/{target}/blobs/{digest}:mount", params={"from": f"acme/{name}"})
        assert mount.status_code == 201, mount.text
        assert client.get(f"/v1/repos/acme/{target}/blobs/{digest}").content == data


def test_concurrent_identical_uploads_both_succeed(store, repo):
    name, token = repo
    data = os.urandom(6 * 1024 * 1024)
    digest = digest_of(data)
    statuses: list[int] = []

    def put() -> None:
        with store.client(token) as client:
            statuses.append(client.put(f"/v1/repos/acme/{name}/blobs/{digest}", content=data).status_code)

    threads = [threading.Thread(target=put) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses == [201, 201]
    assert store.context.storage.size(digest) == len(data)
    with store.client(token, follow_redirects=True) as client:
        assert client.get(f"/v1/repos/acme/{name}/blobs/{digest}").content == data
    if store.is_s3:
        s3 = store.context.storage
        listed = s3.client.list_objects_v2(Bucket=s3.bucket, Prefix=s3.blob_key(digest))
        assert listed["KeyCount"] == 1
