"""``Client`` blob primitives against the running store in both configurations: verified
download into the cache, resume after a dropped connection, cross-process sharing, typed
errors, uploads (monolithic and resumable sessions)."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time

import blake3
import pytest

from cgstore.storage.fs import FileStorage
from cgstore_client import (
    Client,
    Denied,
    InsufficientSpace,
    IntegrityError,
    NotFound,
    Offline,
    Unauthorized,
    Unavailable,
)
from cgstore_client.worker import client as client_module
from cgstore_client.worker.http import Retry
from tests.support.live_store import unique_repo
from tests.support.proxy import CuttableProxy
from tests.support.services import free_port

FAST = Retry(attempts=4, base_s=0.05, cap_s=0.2)


def digest_of(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


@pytest.fixture
def uploaded(store):
    repo = f"acme/{unique_repo()}"
    token = store.mint("worker", f"{repo}:read,write")
    data = os.urandom(3 * 1024 * 1024 + 5)
    digest = digest_of(data)
    with store.client(token) as http:
        assert http.put(f"/v1/repos/{repo}/blobs/{digest}", content=data).status_code == 201
    return repo, token, data, digest


def cache_files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "locks" not in p.parts)


def blob_gets(store) -> int:
    """Blob GETs the store has answered (200, 206 or 307) since it started."""
    text = store.scrape_metrics()
    pattern = r'cgstore_requests_total\{method="GET",route="/v1/repos/\{owner\}/\{repo\}/blobs/\{digest\}",status="(\d+)"\} (\S+)'
    return int(sum(float(n) for status, n in re.findall(pattern, text) if status in ("200", "206", "307")))


def test_fetch_lays_out_the_cache_and_serves_it_again_offline(store, uploaded, tmp_path):
    repo, token, data, digest = uploaded
    with Client(store.base_url, token, cache_dir=tmp_path) as client:
        path = client.fetch_blob(repo, digest, len(data))
    hexdigest = digest.removeprefix("blake3:")
    assert path == tmp_path / "blobs" / "blake3" / hexdigest and path.read_bytes() == data
    assert (tmp_path / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")
    assert cache_files(tmp_path) == ["CACHEDIR.TAG", f"blobs/blake3/{hexdigest}", f"stamps/blake3/{hexdigest}.json"]
    # Offline, on an unreachable URL: served from the cache, no socket needed.
    with Client(f"http://127.0.0.1:{free_port()}", token, cache_dir=tmp_path, offline=True) as offline:
        assert offline.fetch_blob(repo, digest) == path
        with pytest.raises(Offline):
            offline.fetch_blob(repo, digest_of(b"never fetched"))


def test_corrupted_storage_is_refused_and_nothing_is_kept(store, uploaded, tmp_path):
    repo, token, data, digest = uploaded
    storage = store.context.storage
    tampered = b"\x00" + data[1:] if data[0] else b"\x01" + data[1:]
    if isinstance(storage, FileStorage):
        storage._blob_path(digest.removeprefix("blake3:")).write_bytes(tampered)
    else:
        storage.client.put_object(Bucket=storage.bucket, Key=storage.blob_key(digest), Body=tampered)
    with Client(store.base_url, token, cache_dir=tmp_path) as client, pytest.raises(IntegrityError):
        client.fetch_blob(repo, digest)
    assert cache_files(tmp_path) == ["CACHEDIR.TAG"]


def test_errors_are_typed_with_the_protocol_code(store, uploaded, tmp_path):
    repo, token, _, digest = uploaded
    stranger = store.mint("stranger", f"acme/{unique_repo()}:read")
    with Client(store.base_url, stranger, cache_dir=tmp_path) as client, pytest.raises(NotFound) as missing:
        client.fetch_blob(repo, digest)
    assert missing.value.status == 404 and missing.value.code == "BLOB_UNKNOWN" and not missing.value.retryable
    with Client(store.base_url, "not-a-token", cache_dir=tmp_path) as client, pytest.raises(Unauthorized) as bad:
        client.missing(repo, [digest])
    assert bad.value.code == "TOKEN_INVALID"
    reader = store.mint("reader", f"{repo}:read")
    with Client(store.base_url, reader, cache_dir=tmp_path) as client, pytest.raises(Denied) as denied:
        client.missing(repo, [digest])
    assert denied.value.status == 403 and denied.value.code == "DENIED"
    assert cache_files(tmp_path) == ["CACHEDIR.TAG"]


def test_a_stale_stamp_reverifies_and_a_corrupted_cache_entry_is_fetched_again(store, uploaded, tmp_path):
    repo, token, data, digest = uploaded
    with Client(store.base_url, token, cache_dir=tmp_path) as client:
        path = client.fetch_blob(repo, digest)
        before = path.stat()
        with open(path, "r+b") as f:  # bit rot in place: same size and inode
            f.write(b"\xff" if data[0] != 0xFF else b"\x00")
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
        gets = blob_gets(store)
        assert client.fetch_blob(repo, digest).read_bytes() == data  # stamp broken: re-hashed, evicted, fetched
        assert blob_gets(store) == gets + 1
        assert client.fetch_blob(repo, digest) == path and blob_gets(store) == gets + 1  # stamp holds: no fetch


def test_not_enough_disk_fails_before_any_request(tmp_path):
    with Client(f"http://127.0.0.1:{free_port()}", "t", cache_dir=tmp_path) as client, pytest.raises(InsufficientSpace):
        client.fetch_blob("acme/m", digest_of(b"huge"), size=1 << 60)
    assert cache_files(tmp_path) == ["CACHEDIR.TAG"]


@pytest.fixture
def cut_mid_body(store, make_store):
    """(store URL, storage-or-store proxy): the proxy carries the blob bodies, so cutting it drops them."""
    if store.is_s3:
        s3_port = int(store.settings.storage_url.split("endpoint_url=")[1].split("&")[0].rsplit(":", 1)[1])
        proxy = CuttableProxy(s3_port)
        live = make_store("production", s3_public_endpoint_url=f"http://127.0.0.1:{proxy.port}")
        yield live, live.base_url, proxy
    else:
        proxy = CuttableProxy(int(store.base_url.rsplit(":", 1)[1]))
        yield store, f"http://127.0.0.1:{proxy.port}", proxy
    proxy.close()


def test_a_connection_dropped_mid_body_resumes_with_range(cut_mid_body, tmp_path):
    live, url, proxy = cut_mid_body
    repo = f"acme/{unique_repo()}"
    token = live.mint("worker", f"{repo}:read,write")
    data = os.urandom(24 * 1024 * 1024)
    digest = digest_of(data)
    with live.client(token) as http:
        assert http.put(f"/v1/repos/{repo}/blobs/{digest}", content=data).status_code == 201
    received: list[int] = []

    def progress(n: int) -> None:
        received.append(n)
        if len(received) == 2:  # mid-body: drop every live connection, then let new ones through
            proxy.cut()
            proxy.restore()

    with Client(url, token, cache_dir=tmp_path, retry=FAST) as client:
        path = client.fetch_blob(repo, digest, len(data), progress=progress)
    assert path.read_bytes() == data
    assert sum(received) == len(data)  # resumed from where it broke, not restarted
    assert cache_files(tmp_path) == sorted(
        ["CACHEDIR.TAG", f"blobs/blake3/{digest[7:]}", f"stamps/blake3/{digest[7:]}.json"]
    )


def _fetch_in_child(url: str, token: str, cache_dir: str, repo: str, digest: str, size: int) -> None:
    Client(url, token, cache_dir=cache_dir).fetch_blob(repo, digest, size)


def test_eight_processes_fetching_one_digest_download_it_once(store, tmp_path):
    repo = f"acme/{unique_repo()}"
    token = store.mint("worker", f"{repo}:read,write")
    data = os.urandom(16 * 1024 * 1024)
    digest = digest_of(data)
    with store.client(token) as http:
        assert http.put(f"/v1/repos/{repo}/blobs/{digest}", content=data).status_code == 201
    gets = blob_gets(store)
    spawn = multiprocessing.get_context("spawn")
    children = [
        spawn.Process(target=_fetch_in_child, args=(store.base_url, token, str(tmp_path), repo, digest, len(data)))
        for _ in range(8)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
    assert [c.exitcode for c in children] == [0] * 8
    assert blob_gets(store) == gets + 1
    assert (tmp_path / "blobs" / "blake3" / digest[7:]).read_bytes() == data
    assert list((tmp_path / "tmp").iterdir()) == []


SLOW_FETCH = """
import sys, time
from cgstore_client import Client
url, token, cache, repo, digest = sys.argv[1:]
Client(url, token, cache_dir=cache).fetch_blob(repo, digest, progress=lambda n: time.sleep(0.2))
"""


def test_a_killed_download_leaves_nothing_visible(store, tmp_path):
    repo = f"acme/{unique_repo()}"
    token = store.mint("worker", f"{repo}:read,write")
    data = os.urandom(32 * 1024 * 1024)
    digest = digest_of(data)
    with store.client(token) as http:
        assert http.put(f"/v1/repos/{repo}/blobs/{digest}", content=data).status_code == 201
    child = subprocess.Popen([sys.executable, "-c", SLOW_FETCH, store.base_url, token, str(tmp_path), repo, digest])
    deadline = time.monotonic() + 60
    while not list((tmp_path / "tmp").glob("*.part")) or not any(
        p.stat().st_size for p in (tmp_path / "tmp").glob("*.part")
    ):
        assert time.monotonic() < deadline and child.poll() is None
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not (tmp_path / "blobs" / "blake3" / digest[7:]).exists()
    with Client(store.base_url, token, cache_dir=tmp_path) as client:
        assert client.fetch_blob(repo, digest).read_bytes() == data
    assert list((tmp_path / "tmp").iterdir()) == []  # the dead process's temp file was swept


def test_uploads_monolithic_and_resumable_session_after_a_drop(store, tmp_path, monkeypatch):
    repo = f"acme/{unique_repo()}"
    token = store.mint("mint", f"{repo}:read,write")
    small, large = tmp_path / "small.bin", tmp_path / "large.bin"
    small.write_bytes(os.urandom(100_000))
    large.write_bytes(os.urandom(5 * 1024 * 1024 + 17))
    monkeypatch.setattr(client_module, "CHUNK_BYTES", 1024 * 1024)
    proxy = CuttableProxy(int(store.base_url.rsplit(":", 1)[1]))
    sent_chunks: list[int] = []
    real_chunks = client_module.file_chunks

    def chunks_cut_once(path, start, end, chunk=1 << 16):
        sent_chunks.append(start)
        for i, piece in enumerate(real_chunks(path, start, end, chunk)):
            if start == 2 * 1024 * 1024 and sent_chunks.count(start) == 1 and i == 4:
                proxy.cut()  # the third chunk dies midway
                proxy.restore()
            yield piece

    monkeypatch.setattr(client_module, "file_chunks", chunks_cut_once)
    try:
        with Client(
            f"http://127.0.0.1:{proxy.port}",
            token,
            cache_dir=tmp_path / "cache",
            retry=FAST,
            chunked_threshold=1024 * 1024,
        ) as client:
            hashed = client.push_blobs(repo, [small, large])
            assert client.missing(repo, [d for d, _ in hashed.values()]) == []
            assert client.push_blobs(repo, [small, large]) == hashed  # nothing left to send
            for source in (small, large):
                digest, size = hashed[str(source)]
                assert client.fetch_blob(repo, digest, size).read_bytes() == source.read_bytes()
    finally:
        proxy.close()
    assert sent_chunks.count(2 * 1024 * 1024) == 2  # the broken chunk was resent from the store's offset


def test_retries_honour_retry_after_then_give_up(tmp_path):
    """A tiny origin answering 503 (Retry-After: 0) and 429 before the real answer."""
    import http.server
    import threading

    answers = [(503, {"Retry-After": "0"}), (429, {"Retry-After": "0"}), (200, {})]
    seen: list[str] = []

    class Origin(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append(self.path)
            self.rfile.read(int(self.headers["Content-Length"]))
            status, headers = answers.pop(0) if answers else (503, {"Retry-After": "0"})
            body = b'{"missing": []}' if status == 200 else b'{"error": {"code": "UNAVAILABLE", "message": "busy"}}'
            self.send_response(status)
            for k, v in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Origin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with Client(f"http://127.0.0.1:{server.server_port}", "t", cache_dir=tmp_path, retry=FAST) as client:
            assert client.missing("acme/m", [digest_of(b"x")]) == []
            assert len(seen) == 3
            with pytest.raises(Unavailable) as gave_up:
                client.missing("acme/m", [digest_of(b"x")])
            assert gave_up.value.retryable and gave_up.value.retry_after_s == 0 and len(seen) == 3 + FAST.attempts
    finally:
        server.shutdown()


def test_a_resumed_download_whose_tail_differs_is_refused_and_nothing_is_cached(tmp_path):
    """An origin (or a proxy in front of it) cuts the first answer mid-body, then answers the
    ``Range`` request with other tail bytes: the whole stream must hash to the digest."""
    import http.server
    import threading

    data = os.urandom(2 * 1024 * 1024)
    digest, cut = digest_of(data), len(data) // 2
    swapped = data[:cut] + bytes(b ^ 0xFF for b in data[cut:])
    ranges: list[str | None] = []

    class Origin(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            ranges.append(self.headers.get("Range"))
            start = int(self.headers["Range"].removeprefix("bytes=").rstrip("-")) if self.headers.get("Range") else 0
            self.send_response(206 if start else 200)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            if start:
                self.wfile.write(swapped[start:])
            else:
                self.wfile.write(data[:cut])  # then the connection drops
                self.close_connection = True

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Origin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for size in (len(data), None):
            ranges.clear()
            with Client(f"http://127.0.0.1:{server.server_port}", "t", cache_dir=tmp_path, retry=FAST) as client:
                with pytest.raises(IntegrityError):
                    client.fetch_blob("acme/m", digest, size)
            assert ranges == [None, f"bytes={cut}-"]  # it did resume, from where the cut left it
            assert [f for f in cache_files(tmp_path) if f.startswith(("blobs/", "tmp/"))] == []
    finally:
        server.shutdown()
