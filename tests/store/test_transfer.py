"""The client's verified download against a running store, in both configurations."""

from __future__ import annotations

import http.server
import os
import threading

import blake3
import pytest
from cgstore_client.errors import DownloadCorrupt, TransferError
from cgstore_client.transfer import download_blob

from cgstore.storage.fs import FileStorage
from tests.support.live_store import unique_repo


@pytest.fixture
def uploaded(store):
    name = unique_repo()
    token = store.mint("worker", f"acme/{name}:read,write")
    data = os.urandom(3 * 1024 * 1024 + 5)
    digest = "blake3:" + blake3.blake3(data).hexdigest()
    with store.client(token) as client:
        assert client.put(f"/v1/repos/acme/{name}/blobs/{digest}", content=data).status_code == 201
    return name, token, data, digest


def test_verified_download_follows_the_redirect_or_streams(store, uploaded, tmp_path):
    name, token, data, digest = uploaded
    dest = download_blob(store.base_url, token, "acme", name, digest, tmp_path / "model.pt2", expected_size=len(data))
    assert dest.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt2"]  # no temp file left


def test_corrupted_storage_is_caught_and_nothing_is_kept(store, uploaded, tmp_path):
    name, token, data, digest = uploaded
    storage = store.context.storage
    tampered = b"\x00" + data[1:]
    if isinstance(storage, FileStorage):
        storage._blob_path(digest.removeprefix("blake3:")).write_bytes(tampered)
    else:
        storage.client.put_object(Bucket=storage.bucket, Key=storage.blob_key(digest), Body=tampered)
    with pytest.raises(DownloadCorrupt):
        download_blob(store.base_url, token, "acme", name, digest, tmp_path / "model.pt2")
    assert list(tmp_path.iterdir()) == []


def test_unreadable_blob_is_a_typed_miss(store, uploaded, tmp_path):
    name, _, _, digest = uploaded
    stranger = store.mint("stranger", f"acme/{unique_repo()}:read")
    with pytest.raises(TransferError) as refused:
        download_blob(store.base_url, stranger, "acme", name, digest, tmp_path / "model.pt2")
    assert refused.value.status == 404 and refused.value.code == "BLOB_UNKNOWN"
    assert not refused.value.retryable
    assert list(tmp_path.iterdir()) == []


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A tiny origin: /redirect answers 307 to /short; /short promises 1000 bytes and sends 500."""

    seen_headers: list[dict[str, str]] = []

    def do_GET(self) -> None:
        type(self).seen_headers.append(dict(self.headers))
        if self.path.startswith("/v1/"):
            self.send_response(307)
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}/short?X-Amz-Signature=x")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b"x" * 500)
            self.close_connection = True

    def log_message(self, *args) -> None:
        pass


def test_token_stays_home_and_a_short_body_is_refused(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(TransferError, match="early"):
            download_blob(
                f"http://127.0.0.1:{server.server_port}", "secret-token", "acme", "m", "blake3:" + "0" * 64,
                tmp_path / "model.pt2",
            )
    finally:
        server.shutdown()
    to_store, to_storage = _Recorder.seen_headers
    assert to_store["Authorization"] == "Bearer secret-token"
    assert "Authorization" not in to_storage
    assert list(tmp_path.iterdir()) == []
