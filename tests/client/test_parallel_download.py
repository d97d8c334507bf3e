"""Parallel ranged downloads (``cgstore_client.worker.download``): part boundaries, faults, the
connection bound, cross-process sharing.

Against the running store in both configurations where a store is needed (the
embedded store serves the ranges itself; production answers 307 to presigned S3
URLs). Faults the store cannot be made to produce (a server ignoring ``Range``, one
ranged response cut, an expiring presigned URL, counting connections) come from
:class:`Origin`, a tiny loopback blob server.
"""

from __future__ import annotations

import errno
import http.server
import multiprocessing
import os
import re
import threading
import time

import pytest

from cgstore.storage.fs import FileStorage
from cgstore_client import Client, Denied, IntegrityError, Unavailable
from cgstore_client.worker import download as download_module
from cgstore_client.worker.client import ConfigError
from cgstore_client.worker.download import BUFFER_BYTES
from cgstore_client.worker.http import Retry
from tests.client.test_client_blobs import blob_gets, cache_files, cut_mid_body, digest_of  # noqa: F401 (fixture)
from tests.support.live_store import unique_repo

FAST = Retry(attempts=4, base_s=0.05, cap_s=0.2)
P = 64 * 1024


def parts(size: int) -> int:
    """Ranged GETs one download of ``size`` bytes makes (a blob of at most one part is one stream)."""
    return max(1, -(-size // P))


def put_blob(store, data: bytes) -> tuple[str, str, str]:
    repo = f"acme/{unique_repo()}"
    token = store.mint("worker", f"{repo}:read,write")
    digest = digest_of(data)
    with store.client(token) as http_client:
        assert http_client.put(f"/v1/repos/{repo}/blobs/{digest}", content=data).status_code == 201
    return repo, token, digest


def store_gets_for(store, size: int) -> int:
    """Blob GETs the store answers for one download: every part (embedded), or one 307 (S3)."""
    return 1 if store.is_s3 else parts(size)


def only_the_blob(root, digest: str) -> list[str]:
    return sorted(["CACHEDIR.TAG", f"blobs/blake3/{digest[7:]}", f"stamps/blake3/{digest[7:]}.json"])


@pytest.mark.parametrize("size", [0, 1, P - 1, P, P + 1, 7 * P + 3])
def test_part_boundaries(store, size, tmp_path):
    data = os.urandom(size)
    repo, token, digest = put_blob(store, data)
    gets = blob_gets(store)
    received: list[int] = []
    with Client(store.base_url, token, cache_dir=tmp_path, download_connections=3, download_part_bytes=P) as client:
        path = client.fetch_blob(repo, digest, size, progress=received.append)
    assert path.read_bytes() == data and sum(received) == size
    assert blob_gets(store) == gets + store_gets_for(store, size)
    assert cache_files(tmp_path) == only_the_blob(tmp_path, digest)


def test_a_corrupted_byte_in_one_part_is_refused_and_nothing_is_kept(store, tmp_path):
    data = os.urandom(6 * P)
    repo, token, digest = put_blob(store, data)
    at = 4 * P + 17
    tampered = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
    storage = store.context.storage
    if isinstance(storage, FileStorage):
        storage._blob_path(digest.removeprefix("blake3:")).write_bytes(tampered)
    else:
        storage.client.put_object(Bucket=storage.bucket, Key=storage.blob_key(digest), Body=tampered)
    with Client(store.base_url, token, cache_dir=tmp_path, download_part_bytes=P) as client:
        with pytest.raises(IntegrityError):
            client.fetch_blob(repo, digest, len(data))
    assert cache_files(tmp_path) == ["CACHEDIR.TAG"]
    assert list((tmp_path / "tmp").iterdir()) == []


def test_every_connection_dropped_mid_body_resumes_each_part_where_it_stopped(cut_mid_body, tmp_path):  # noqa: F811
    live, url, proxy = cut_mid_body
    data = os.urandom(64 * P)
    repo, token, digest = put_blob(live, data)
    received: list[int] = []

    def progress(n: int) -> None:
        received.append(n)
        if len(received) == 6:  # parts in flight: drop every live connection, then let new ones through
            proxy.cut()
            proxy.restore()

    with Client(
        url, token, cache_dir=tmp_path, retry=FAST, download_connections=4, download_part_bytes=4 * P
    ) as client:
        path = client.fetch_blob(repo, digest, len(data), progress=progress)
    assert path.read_bytes() == data
    assert sum(received) == len(data)  # no byte fetched twice: each part resumed from where it broke
    assert cache_files(tmp_path) == only_the_blob(tmp_path, digest)


def _fetch_in_child(url: str, token: str, cache_dir: str, repo: str, digest: str, size: int) -> None:
    Client(url, token, cache_dir=cache_dir, download_part_bytes=P).fetch_blob(repo, digest, size)


def test_processes_fetching_one_digest_download_it_once(store, tmp_path):
    data = os.urandom(40 * P + 5)
    repo, token, digest = put_blob(store, data)
    gets = blob_gets(store)
    spawn = multiprocessing.get_context("spawn")
    children = [
        spawn.Process(target=_fetch_in_child, args=(store.base_url, token, str(tmp_path), repo, digest, len(data)))
        for _ in range(4)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
    assert [c.exitcode for c in children] == [0] * 4
    assert blob_gets(store) == gets + store_gets_for(store, len(data))
    assert (tmp_path / "blobs" / "blake3" / digest[7:]).read_bytes() == data
    assert list((tmp_path / "tmp").iterdir()) == []


# --- a loopback blob server for the faults the store does not produce ---------------------

RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class Origin:
    """Serves blobs at ``.../blobs/<digest>`` (ranges honoured unless ``ignore_range``), optionally
    307-redirecting them to ``http://localhost:<port>/s3/<generation>/<digest>``, a presigned URL
    stand-in that expires as ``expiries`` say. Logs (path, Range, status, Authorization) per request
    and the peak number of responses in flight."""

    def __init__(self, blobs: dict[str, bytes], *, ignore_range=False, redirect=False, delay_s=0.0) -> None:
        self.blobs, self.ignore_range, self.redirect, self.delay_s = blobs, ignore_range, redirect, delay_s
        self.stop_at: int | None = None  # bodies crossing this offset end there, their length still promised ...
        self.stops: int | None = None  # ... this many times (None: every time)
        self.generation = 1
        self.cut_at: int | None = None  # the first ranged response starting here stops halfway
        self.expiries: list[int] = []  # presigned URLs expire once S3 has served this many GETs
        self.log: list[tuple[str, str | None, int, str | None]] = []
        self.active = self.peak = 0
        self.lock = threading.Lock()
        origin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                origin.serve(self)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def serve(self, handler) -> None:
        path, ranged = handler.path, handler.headers.get("Range")
        digest = path.rsplit("/", 1)[1]
        with self.lock:
            if path.startswith("/s3/"):
                served = sum(p.startswith("/s3/") and status != 403 for p, _, status, _ in self.log)
                if self.expiries and served >= self.expiries[0]:
                    self.expiries.pop(0)
                    self.generation += 1
                if int(path.split("/")[2]) != self.generation:
                    return self._answer(handler, 403, b"<Error><Code>AccessDenied</Code></Error>", {})
            elif self.redirect:
                location = f"http://localhost:{self.server.server_port}/s3/{self.generation}/{digest}"
                return self._answer(handler, 307, b"", {"Location": location})
        data = self.blobs[digest]
        start, end = 0, len(data)
        match = RANGE.fullmatch(ranged or "")
        if match and not self.ignore_range:
            start, end = int(match[1]), (int(match[2]) + 1 if match[2] else len(data))
        headers = {"Content-Length": str(end - start)}
        if start or end != len(data):
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        with self.lock:
            self.log.append(
                (path, ranged, 206 if "Content-Range" in headers else 200, handler.headers.get("Authorization"))
            )
            cut = self.cut_at == start and ranged is not None
            if cut:
                self.cut_at = None
            self.active += 1
            self.peak = max(self.peak, self.active)
        handler.send_response(206 if "Content-Range" in headers else 200)
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.end_headers()
        stop = start + (end - start) // 2 if cut else end
        with self.lock:
            if self.stop_at is not None and start <= self.stop_at < end and self.stops != 0:
                stop = self.stop_at
                self.stops = None if self.stops is None else self.stops - 1
        step = 16 * 1024
        for offset in range(start, stop, step):
            time.sleep(self.delay_s)
            if offset + step >= stop:
                with self.lock:  # before the last bytes: the client cannot have moved on yet
                    self.active -= 1
            handler.wfile.write(data[offset : min(offset + step, stop)])
        if stop == start:
            with self.lock:
                self.active -= 1
        handler.close_connection = True

    def _answer(self, handler, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.log.append((handler.path, handler.headers.get("Range"), status, handler.headers.get("Authorization")))
        handler.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(body)
        handler.close_connection = True


@pytest.fixture
def blob():
    data = os.urandom(8 * P + 100)
    return digest_of(data), data


def fetch(origin: Origin, digest: str, size: int, cache_dir, **kwargs):
    with Client(origin.url, "tok", cache_dir=cache_dir, retry=FAST, download_part_bytes=P, **kwargs) as client:
        return client.fetch_blob("acme/m", digest, size)


def test_a_server_ignoring_range_is_read_as_one_stream(blob, tmp_path):
    digest, data = blob
    origin = Origin({digest: data}, ignore_range=True)
    try:
        assert fetch(origin, digest, len(data), tmp_path).read_bytes() == data
    finally:
        origin.close()
    assert origin.log[0][1:3] == (f"bytes=0-{P - 1}", 200)  # a 200 to the first part ...
    assert origin.log[-1][1:3] == (None, 200)  # ... and the blob fetched again as one stream
    assert len(origin.log) == 2
    assert list((tmp_path / "tmp").iterdir()) == []


def test_one_cut_part_is_retried_alone_from_where_it_stopped(blob, tmp_path):
    digest, data = blob
    origin = Origin({digest: data})
    origin.cut_at = 3 * P
    try:
        assert fetch(origin, digest, len(data), tmp_path).read_bytes() == data
    finally:
        origin.close()
    ranges = sorted(r for _, r, _, _ in origin.log)
    expected = sorted(
        [f"bytes={s}-{min(s + P, len(data)) - 1}" for s in range(0, len(data), P)]
        + [f"bytes={3 * P + P // 2}-{4 * P - 1}"]
    )
    assert ranges == expected  # every part once, and the second half of the cut one


def test_one_bound_on_connections_across_every_blob_of_a_client(tmp_path):
    blobs = {digest_of(d): d for d in (os.urandom(6 * P + i) for i in range(3))}
    origin = Origin(blobs, delay_s=0.01)
    try:
        with Client(origin.url, "tok", cache_dir=tmp_path, download_connections=3, download_part_bytes=P) as client:
            threads = [threading.Thread(target=client.fetch_blob, args=("acme/m", d, len(b))) for d, b in blobs.items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            for digest, data in blobs.items():
                assert client.cache.verified(digest, len(data)).read_bytes() == data
    finally:
        origin.close()
    assert origin.peak == 3  # parallel, but never more than the client's bound (3 blobs x 3 without it)


def test_an_expired_presigned_url_is_resolved_again_once(blob, tmp_path):
    digest, data = blob
    origin = Origin({digest: data}, redirect=True)
    origin.expiries = [3]
    try:
        assert fetch(origin, digest, len(data), tmp_path, download_connections=2).read_bytes() == data
        store_asked = [entry for entry in origin.log if not entry[0].startswith("/s3/")]
        assert len(store_asked) == 2  # the first part, then once more after the expiry
        assert all(auth is None for path, _, _, auth in origin.log if path.startswith("/s3/"))  # no token to S3
        assert {auth for path, _, _, auth in store_asked} == {"Bearer tok"}
        # Expiring again after the renewal: the refusal stands, and nothing is left behind.
        origin.expiries, other = [2, 4], os.urandom(6 * P)
        origin.blobs[digest_of(other)] = other
        origin.log.clear()
        with pytest.raises(Denied):
            fetch(origin, digest_of(other), len(other), tmp_path / "again", download_connections=2)
    finally:
        origin.close()
    assert list((tmp_path / "again" / "tmp").iterdir()) == []


def test_download_settings_come_from_arguments_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CGSTORE_DOWNLOAD_CONNECTIONS", "3")
    monkeypatch.setenv("CGSTORE_DOWNLOAD_PART_BYTES", str(P))
    with Client("http://127.0.0.1:9", "t", cache_dir=tmp_path) as client:
        assert (client.downloads.slots.connections, client.downloads.part_bytes) == (3, P)
    with Client("http://127.0.0.1:9", "t", cache_dir=tmp_path, download_connections=5) as client:
        assert client.downloads.slots.connections == 5
    monkeypatch.setenv("CGSTORE_DOWNLOAD_CONNECTIONS", "many")
    with pytest.raises(ConfigError, match="CGSTORE_DOWNLOAD_CONNECTIONS"):
        Client("http://127.0.0.1:9", "t", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="CGSTORE_DOWNLOAD_PART_BYTES"):
        Client("http://127.0.0.1:9", "t", cache_dir=tmp_path, download_connections=1, download_part_bytes=0)


@pytest.mark.parametrize("size", [3 * BUFFER_BYTES + 5, 4 * BUFFER_BYTES])
def test_parts_that_are_not_whole_buffers(store, size, tmp_path):
    """Parts of two buffers + 3 bytes: part ends fall inside a buffer, and a blob ends mid-part."""
    part = 2 * BUFFER_BYTES + 3
    data = os.urandom(size)
    repo, token, digest = put_blob(store, data)
    received: list[int] = []
    with Client(store.base_url, token, cache_dir=tmp_path, download_part_bytes=part) as client:
        assert client.downloads.slots.buffer_bytes == BUFFER_BYTES < part
        path = client.fetch_blob(repo, digest, size, progress=received.append)
    assert path.read_bytes() == data and sum(received) == size
    assert max(received) <= BUFFER_BYTES
    assert cache_files(tmp_path) == only_the_blob(tmp_path, digest)


def test_a_prefix_hashed_from_an_offset_inside_a_page(blob, tmp_path):
    """The first part cut after 1001 bytes: the hash takes those, then goes on from inside a page (mapped from the
    page's start) when the part resumes there."""
    digest, data = blob
    origin = Origin({digest: data})
    origin.stop_at, origin.stops = 1001, 1
    try:
        assert fetch(origin, digest, len(data), tmp_path, download_connections=2).read_bytes() == data
    finally:
        origin.close()
    assert f"bytes=1001-{P - 1}" in [r for _, r, _, _ in origin.log]  # resumed inside the first page


@pytest.mark.parametrize("stop_at", [3 * P + 1000, 5])
def test_a_body_short_of_its_length_mid_buffer_is_a_typed_error_and_nothing_is_renamed(blob, stop_at, tmp_path):
    """A server that keeps closing inside one part, short of the length it promised: retried from where it stopped
    while that makes progress, then Unavailable; the other parts' bytes are never renamed into the cache."""
    digest, data = blob
    origin = Origin({digest: data})
    origin.stop_at = stop_at
    try:
        with pytest.raises(Unavailable, match="early"):
            fetch(origin, digest, len(data), tmp_path, download_connections=3)
    finally:
        origin.close()
    assert cache_files(tmp_path) == ["CACHEDIR.TAG"]
    assert list((tmp_path / "tmp").iterdir()) == []
    part = stop_at // P * P
    retried = [r for _, r, _, _ in origin.log if r == f"bytes={stop_at}-{part + P - 1}"]
    # The first attempt reached the cut (progress, so one failure); each resumes at the cut, never before it,
    # until the failures without progress reach the attempts.
    assert len(retried) == FAST.attempts - 1


def test_a_cache_on_a_file_system_that_cannot_map_files_hashes_by_reading_back(blob, tmp_path, monkeypatch):
    def cannot_map(*args, **kwargs):
        raise OSError(errno.ENODEV, "no mmap on this file system")

    monkeypatch.setattr(download_module.mmap, "mmap", cannot_map)
    digest, data = blob
    origin = Origin({digest: data})
    try:
        assert fetch(origin, digest, len(data), tmp_path, download_connections=3).read_bytes() == data
        tampered = digest_of(data[:-1] + bytes([data[-1] ^ 1]))  # the digest of other bytes: refused
        origin.blobs[tampered] = data
        with pytest.raises(IntegrityError):
            fetch(origin, tampered, len(data), tmp_path / "other", download_connections=3)
    finally:
        origin.close()
