"""SIGKILL at named points of upload and commit: nothing partial is visible, a retry succeeds.

The store runs as its own process started with ``CGSTORE_CRASH_AT=<point>``
(``cgstore.core.faults``); the request that reaches the point kills it without
cleanup. A fresh process on the same database and bucket must then serve a
consistent registry: the invariant checker finds nothing broken, the blob is
either absent or whole, and the interrupted operation succeeds when retried.
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.faults.conftest import blob_of, unique_bytes
from tests.support.services import store_process

pytestmark = pytest.mark.slow


def _client(store, token: str) -> httpx.Client:
    return httpx.Client(base_url=store.base_url, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def _expect_killed(store, request) -> None:
    with pytest.raises(httpx.TransportError):
        request()
    assert store.process.wait(15) == -signal.SIGKILL


def _absent_or_whole(client: httpx.Client, repo: str, data: bytes) -> None:
    got = client.get(f"/v1/repos/acme/{repo}/blobs/{blob_of(data)}")
    assert got.status_code in (200, 404), got.text
    if got.status_code == 200:
        assert got.content == data


def test_killed_between_storing_and_linking_a_monolithic_upload(world):
    token = world.token("faults-crash", "acme/*:read,write")
    data = unique_bytes("crash-upload.stored", 64 * 1024)
    url = f"/v1/repos/acme/crash-put/blobs/{blob_of(data)}"
    with (
        store_process({**world.env, "CGSTORE_CRASH_AT": "upload.stored"}, world.home) as store,
        _client(store, token) as client,
    ):
        _expect_killed(store, lambda: client.put(url, content=data))
    world.assert_invariants()
    with store_process(world.env, world.home) as store, _client(store, token) as client:
        assert client.get(url).status_code == 404  # stored bytes without a link are not visible
        assert client.put(url, content=data).status_code == 201
        assert client.get(url).content == data
    world.assert_invariants()


@pytest.mark.parametrize("chunk", [8192, 6 << 20], ids=["small", "parts"])
def test_killed_after_staging_a_chunk_before_its_offset_moved(world, chunk):
    """With 6 MiB chunks and 5 MiB parts, the killed append's parts sit in the session's
    multipart upload under numbers no recorded state names: the resumed append must take
    other numbers, and the commit (in yet another process) must complete only the recorded ones."""
    token = world.token("faults-crash", "acme/*:read,write")
    env = {**world.env, "CGSTORE_S3_PART_BYTES": str(5 << 20)}
    data = unique_bytes("crash-session.staged", 2 * chunk)
    with store_process(env, world.home) as store, _client(store, token) as client:
        location = client.post(f"/v1/repos/acme/crash-chunk-{chunk}/uploads").headers["Location"]
        first = {"content": data[:chunk], "headers": {"Content-Range": f"0-{chunk - 1}"}}
        assert client.patch(location, **first).status_code == 202
    second = {"content": data[chunk:], "headers": {"Content-Range": f"{chunk}-{2 * chunk - 1}"}}
    killed_with = os.urandom(chunk)  # other bytes at the same offset: they must not leak into the blob
    with (
        store_process({**env, "CGSTORE_CRASH_AT": "session.staged"}, world.home) as store,
        _client(store, token) as client,
    ):
        _expect_killed(store, lambda: client.patch(location, content=killed_with, headers=second["headers"]))
    with store_process(env, world.home) as store, _client(store, token) as client:
        # The chunk the crash interrupted does not count: the session resumes where it was.
        assert client.get(location).headers["Upload-Offset"] == str(chunk)
        assert client.patch(location, **second).status_code == 202
    with store_process(env, world.home) as store, _client(store, token) as client:
        assert client.put(location, params={"digest": blob_of(data)}).status_code == 201
        assert client.get(f"/v1/repos/acme/crash-chunk-{chunk}/blobs/{blob_of(data)}").content == data
    world.assert_invariants()


def test_killed_between_committing_the_staged_bytes_and_linking(world):
    token = world.token("faults-crash", "acme/*:read,write")
    data = unique_bytes("crash-commit.stored", 8192)
    with store_process(world.env, world.home) as store, _client(store, token) as client:
        location = client.post("/v1/repos/acme/crash-commit/uploads").headers["Location"]
        assert client.patch(location, content=data, headers={"Content-Range": "0-8191"}).status_code == 202
    with (
        store_process({**world.env, "CGSTORE_CRASH_AT": "commit.stored"}, world.home) as store,
        _client(store, token) as client,
    ):
        _expect_killed(store, lambda: client.put(location, params={"digest": blob_of(data)}))
    world.assert_invariants()
    with store_process(world.env, world.home) as store, _client(store, token) as client:
        _absent_or_whole(client, "crash-commit", data)
        # The session's staging was consumed by the commit: the client starts over, and succeeds.
        fresh = client.post("/v1/repos/acme/crash-commit/uploads").headers["Location"]
        assert client.put(fresh, params={"digest": blob_of(data)}, content=data).status_code == 201
        assert client.get(f"/v1/repos/acme/crash-commit/blobs/{blob_of(data)}").content == data
    world.assert_invariants()
