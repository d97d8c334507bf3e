"""Operational endpoints, abandoned uploads, and outages of the database and of storage."""

from __future__ import annotations

import os
import socket
import time

import blake3
import pytest

from tests.support.leftovers import leftover_staging, leftover_writes
from tests.support.live_store import unique_repo
from tests.support.proxy import CuttableProxy


def digest_of(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def wait_until(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def test_healthz_and_readyz(store):
    with store.client() as client:
        assert client.get("/healthz").status_code == 200
        ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"database": "ok", "storage": "ok"}


def test_metrics_count_requests_bytes_and_sessions(store):
    name = unique_repo()
    token = store.mint("alice", f"acme/{name}:read,write")
    data = os.urandom(12345)
    with store.client(token) as client:
        client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(data)}", content=data)
        client.post(f"/v1/repos/acme/{name}/uploads")
        text = client.get("/metrics", headers=store.metrics_headers()).text
    assert 'cgstore_requests_total{method="PUT",route="/v1/repos/{owner}/{repo}/blobs/{digest}",status="201"}' in text
    assert "cgstore_request_seconds_bucket" in text
    bytes_in = next(line for line in text.splitlines() if line.startswith("cgstore_bytes_in_total"))
    assert float(bytes_in.split()[-1]) >= len(data)
    open_sessions = next(line for line in text.splitlines() if line.startswith("cgstore_upload_sessions_open"))
    assert float(open_sessions.split()[-1]) >= 1


def test_client_killed_mid_upload_leaves_nothing(store):
    name = unique_repo()
    token = store.mint("alice", f"acme/{name}:read,write")
    data = os.urandom(8 * 1024 * 1024)
    digest = digest_of(data)
    host, port = store.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            (
                f"PUT /v1/repos/acme/{name}/blobs/{digest} HTTP/1.1\r\nHost: {host}\r\n"
                f"Authorization: Bearer {token}\r\nContent-Length: {len(data)}\r\n\r\n"
            ).encode()
        )
        sock.sendall(data[: 3 * 1024 * 1024])
        time.sleep(0.3)
    # The server notices the disconnect, aborts the write, and leaves nothing behind.
    wait_until(lambda: not leftover_writes(store.context.storage))
    with store.client(token) as client:
        assert client.head(f"/v1/repos/acme/{name}/blobs/{digest}").status_code == 404
    assert store.context.storage.size(digest) is None


@pytest.mark.parametrize("configuration", ["embedded", "production"])
def test_abandoned_session_expires_and_its_bytes_are_reclaimed(make_registry, configuration):
    # A registry of its own: the reaper sweeps the whole bucket, and this test looks at all of it.
    live = make_registry(configuration, upload_session_ttl_s=1, reaper_interval_s=0.2, s3_part_bytes=5 * 1024 * 1024)
    name = unique_repo()
    token = live.mint("alice", f"acme/{name}:read,write")
    # A write whose process died mid-upload: no session row, only bytes in storage.
    orphan = live.context.storage.writer(digest_of(b"never finished"))
    orphan.write(os.urandom(11 * 1024 * 1024))
    assert leftover_writes(live.context.storage)
    with live.client(token) as client:
        location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
        assert client.patch(location, content=b"z" * 100_000, headers={"Content-Range": "0-99999"}).status_code == 202
        assert leftover_staging(live.context.storage)
        wait_until(lambda: client.get(location).status_code == 404)
        wait_until(lambda: not leftover_staging(live.context.storage))


def test_storage_outage_is_503_with_retry_after(make_store, s3_server):
    """S3 disappears mid-session: reads and writes answer 503 UNAVAILABLE, nothing half-written."""
    proxy = CuttableProxy(int(s3_server.endpoint_url.rsplit(":", 1)[1]))
    try:
        bucket = s3_server.create_bucket()
        live = make_store(
            "embedded",
            storage_url=f"s3://{bucket}?endpoint_url=http://127.0.0.1:{proxy.port}&region=us-east-1",
            redirect_downloads=False,
        )
        name = unique_repo()
        token = live.mint("alice", f"acme/{name}:read,write")
        kept, lost = b"before the outage", os.urandom(7 * 1024 * 1024)
        with live.client(token) as client:
            assert client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(kept)}", content=kept).status_code == 201
            proxy.cut()
            started = time.monotonic()
            write = client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(lost)}", content=lost)
            assert write.status_code == 503 and write.json()["error"]["code"] == "UNAVAILABLE"
            assert int(write.headers["retry-after"]) > 0
            assert time.monotonic() - started < 30
            read = client.get(f"/v1/repos/acme/{name}/blobs/{digest_of(kept)}")
            assert read.status_code == 503
            assert client.get("/readyz").status_code == 503
            proxy.restore()
            assert client.head(f"/v1/repos/acme/{name}/blobs/{digest_of(lost)}").status_code == 404
            assert client.get(f"/v1/repos/acme/{name}/blobs/{digest_of(kept)}").content == kept
            assert client.get("/readyz").status_code == 200
    finally:
        proxy.close()


def test_database_outage_is_503_with_retry_after(make_store, pg_url):
    """PostgreSQL disappears mid-session: 503 UNAVAILABLE, and service resumes when it returns."""
    proxy = CuttableProxy(5432)
    try:
        live = make_store("embedded", database_url=pg_url.replace(":5432/", f":{proxy.port}/"))
        name = unique_repo()
        token = live.mint("alice", f"acme/{name}:read,write")
        data = b"written while the database is away"
        with live.client(token) as client:
            proxy.cut()
            write = client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(data)}", content=data)
            assert write.status_code == 503 and write.json()["error"]["code"] == "UNAVAILABLE"
            assert write.headers["retry-after"]
            assert client.get("/readyz").status_code == 503
            proxy.restore()
            wait_until(lambda: client.get("/readyz").status_code == 200)
            assert client.head(f"/v1/repos/acme/{name}/blobs/{digest_of(data)}").status_code == 404
            assert client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(data)}", content=data).status_code == 201
    finally:
        proxy.close()


def test_unknown_route_is_a_typed_404(store):
    with store.client() as client:
        answer = client.get("/v1/nothing-here")
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "NAME_UNKNOWN"
