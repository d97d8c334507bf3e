"""``Client`` configuration, its thin import, and what it sends where (no store needed)."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading

import pytest

from cgstore_client import Client, Offline, Unavailable
from cgstore_client.worker.client import DEFAULT_URL, ConfigError
from cgstore_client.worker.http import Retry
from tests.support.services import free_port


def test_the_client_imports_without_torch_or_server_libraries():
    probe = (
        "import sys, cgstore_client\n"
        "from cgstore_client import Client, Want, IntegrityError, NotFound, Denied, Unauthorized, Conflict, "
        "Unavailable, CompiledRequired\n"
        "print(sorted(m for m in ('torch', 'fastapi', 'sqlalchemy', 'boto3', 'botocore', 'cgstore', 'starlette')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().replace("'", '"')) == []


def test_configuration_from_the_environment(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    monkeypatch.setenv("CGSTORE_URL", "http://store.example:9000/")
    monkeypatch.delenv("CGSTORE_TOKEN", raising=False)
    monkeypatch.setenv("CGSTORE_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("CGSTORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CGSTORE_OFFLINE", "1")
    client = Client()
    assert (client.url, client.token, client.cache.root, client.offline) == (
        "http://store.example:9000",
        "from-file",
        tmp_path / "cache",
        True,
    )
    assert (tmp_path / "cache" / "CACHEDIR.TAG").exists()
    with pytest.raises(Offline):
        client.missing("acme/m", ["blake3:" + "0" * 64])
    monkeypatch.setenv("CGSTORE_TOKEN", "from-env")
    monkeypatch.setenv("CGSTORE_OFFLINE", "0")
    assert (Client().token, Client().offline) == ("from-env", False)
    explicit = Client("http://other:1", "given", cache_dir=tmp_path / "c2", offline=False)
    assert (explicit.url, explicit.token, explicit.cache.root) == ("http://other:1", "given", tmp_path / "c2")
    monkeypatch.delenv("CGSTORE_URL")
    assert Client().url == DEFAULT_URL
    monkeypatch.delenv("CGSTORE_TOKEN")
    monkeypatch.setenv("CGSTORE_TOKEN_FILE", str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="CGSTORE_TOKEN_FILE"):
        Client()


def test_a_redirect_to_another_host_never_carries_the_token(tmp_path):
    """The store's 307 points at storage on another origin: the token stays home."""
    seen: dict[str, dict[str, str]] = {}

    class Storage(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen["storage"] = dict(self.headers)
            self.send_response(200)
            self.send_header("Content-Length", "3")
            self.end_headers()
            self.wfile.write(b"abc")

        def log_message(self, *args) -> None:
            pass

    storage = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Storage)

    class Store(Storage):
        def do_GET(self) -> None:
            seen["store"] = dict(self.headers)
            self.send_response(307)
            self.send_header("Location", f"http://127.0.0.1:{storage.server_port}/obj?X-Amz-Signature=x")
            self.send_header("Content-Length", "0")
            self.end_headers()

    store = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Store)
    for server in (storage, store):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        import blake3

        digest = "blake3:" + blake3.blake3(b"abc").hexdigest()
        with Client(f"http://127.0.0.1:{store.server_port}", "secret-token", cache_dir=tmp_path) as client:
            assert client.fetch_blob("acme/m", digest).read_bytes() == b"abc"
    finally:
        store.shutdown()
        storage.shutdown()
    assert seen["store"]["Authorization"] == "Bearer secret-token"
    assert "Authorization" not in seen["storage"]


def test_an_unreachable_store_is_a_retryable_unavailable(tmp_path):
    with Client(f"http://127.0.0.1:{free_port()}", "t", cache_dir=tmp_path, retry=Retry(attempts=2, base_s=0.01)) as c:
        with pytest.raises(Unavailable) as down:
            c.fetch_blob("acme/m", "blake3:" + "0" * 64)
    assert down.value.retryable and down.value.status is None
    assert list((tmp_path / "tmp").iterdir()) == []


def test_boot_and_discover_spell_out_their_keywords():
    """``help(client.boot)`` and type checkers see every keyword of a declaration (no ``**options``)."""
    import inspect

    boot = inspect.signature(Client.boot).parameters
    assert {
        "toolchain",
        "sm",
        "release",
        "code",
        "mandatory",
        "confirm",
        "example_inputs",
        "checkpoint",
        "device",
    } <= set(boot)
    discover = inspect.signature(Client.discover).parameters
    assert {"release", "binding_signature", "code", "limit"} <= set(discover)
    for parameters in (boot, discover):
        assert all(p.kind != inspect.Parameter.VAR_KEYWORD for p in parameters.values())
