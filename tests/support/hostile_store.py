"""A loopback server playing a hostile store (or a man in the middle), for the client-as-a-victim tests.

:class:`HostileStore` answers the routes a test gives it with raw HTTP bytes it
controls: an answer can be trickled (its headers too), endless, longer than it
says, or cut after a byte per connection; it signs receipts with an Ed25519 key
of its own and serves that key as its JWKS, as a compromised store would; and it
logs every request it gets (method, path, headers) and the bytes it sent. With no
routes it is a *sink*: a host the client must never send anything to.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import http.server
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import blake3
import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

KEY = "ck1-" + "ab" * 28
REPO = "acme/m"
FAMILY = "hostile-family"


@dataclass
class Answer:
    """What a route answers: ``body`` (bytes, or chunks produced lazily), sent after ``head_delay_s``.

    ``trickle_s``: pause before every byte of the body (and of the status line and headers, ``trickle_head``).
    ``length``: the Content-Length to declare (None: the body's, ``False``: none, the body ends at close).
    """

    body: bytes | Callable[[], Iterable[bytes]] = b""
    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})
    length: int | bool | None = None
    trickle_s: float | None = None
    trickle_head: bool = False


def json_answer(document: object, **options) -> Answer:
    return Answer(json.dumps(document).encode(), **options)


Route = Answer | Callable[[bytes, dict[str, str]], Answer]


class HostileStore:
    def __init__(self, kid: str = "hostile-1") -> None:
        self.routes: dict[tuple[str, str], Route] = {}
        self.log: list[tuple[str, str, dict[str, str]]] = []
        self.sent: dict[str, int] = {}  # path -> bytes written (headers included)
        self.keys = {kid: Ed25519PrivateKey.generate()}
        self.signer = kid
        self.lock = threading.Lock()
        self.answered = threading.Condition(self.lock)  # notified as each answer ends (written or cut)
        self.finished: dict[str, int] = {}  # path -> answers ended
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_one_request(self) -> None:
                with contextlib.suppress(ConnectionError, TimeoutError):
                    super().handle_one_request()

            def __getattr__(self, name: str):
                if name.startswith("do_"):
                    return lambda: owner._serve(self, name[3:])
                raise AttributeError(name)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> HostileStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- keys and receipts ---------------------------------------------------------------------

    def jwk(self, kid: str) -> dict[str, str]:
        raw = self.keys[kid].public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        x = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
        return {"kty": "OKP", "crv": "Ed25519", "x": x, "kid": kid, "alg": "EdDSA", "use": "sig"}

    def jwks(self) -> dict[str, list[dict[str, str]]]:
        return {"keys": [self.jwk(kid) for kid in self.keys]}

    def rotate(self, kid: str) -> None:
        """A new signing key, listed beside the others (what ``cgstore keys rotate`` does)."""
        self.keys[kid] = Ed25519PrivateKey.generate()
        self.signer = kid

    def receipt(self, key: str, repo: str, artifact: str) -> str:
        claims = {
            "iss": "hostile",
            "aud": "cgstore-receipt",
            "iat": int(time.time()),
            "repo": repo,
            "key": key,
            "artifact": artifact,
            "components": {},
            "graph": "g1:" + "0" * 64,
            "publisher": "mallory",
        }
        return jwt.encode(
            claims,
            self.keys[self.signer],
            algorithm="EdDSA",
            headers={"kid": self.signer, "typ": "cgstore-receipt+jwt"},
        )

    # --- a whole store for one record ----------------------------------------------------------

    def serve_record(self, blob: bytes, *, href: str | None = None, blob_answer: Answer | None = None) -> str:
        """Serve ``/v1/keys``, a resolve hit for :data:`KEY` (its ``href`` as given), the blob and the
        record; returns the blob's digest."""
        digest = "blake3:" + blake3.blake3(blob).hexdigest()
        record_path = f"/v1/repos/{REPO}/compiled-graphs/{KEY}"
        self.routes[("GET", "/v1/keys")] = lambda body, headers: json_answer(self.jwks())
        self.routes[("POST", "/v1/compiled-graphs:resolve")] = lambda body, headers: json_answer(
            {"answers": [self.hit(digest, len(blob), href or record_path)]}
        )
        self.routes[("GET", f"/v1/repos/{REPO}/blobs/{digest}")] = blob_answer or Answer(
            blob, headers={"Content-Type": "application/octet-stream"}
        )
        self.routes[("GET", record_path)] = lambda body, headers: json_answer(self.record(digest, len(blob)))
        return digest

    def hit(self, digest: str, size: int, href: str) -> dict:
        facts = {
            "kind": "aoti",
            "format": "pt2",
            "family": FAMILY,
            "lane": "baseline+dense",
            "sm": "cpu",
            "graph": "g1:" + "0" * 64,
            "envelope_digest": "e",
            "toolchain_digest": "t",
            "layout": None,
            "created_at": "2026-12-06T00:00:00Z",
            "href": href,
        }
        return {
            "key": KEY,
            "status": "hit",
            "repo": REPO,
            "record": facts,
            "artifact": {"digest": digest, "size": size, "url": f"{self.url}/v1/repos/{REPO}/blobs/{digest}"},
            "components": [],
            "receipt": self.receipt(KEY, REPO, digest),
        }

    def record(self, digest: str, size: int) -> dict:
        manifest = {
            "kind": "aoti",
            "format": "pt2",
            "family": FAMILY,
            "lane": "baseline+dense",
            "axes": {
                "graph": "g1:" + "0" * 64,
                "envelope": {},
                "sm": "cpu",
                "toolchain": {"components": {"torch": "2.13.0"}},
            },
            "artifact": {"digest": digest, "size": size},
        }
        return {
            "key": KEY,
            "repo": REPO,
            "manifest": manifest,
            "input_contract": {},
            "binding_table": [],
            "kernel_lane": None,
            "publisher": {"principal": "mallory", "jti": None},
            "created_at": dt.datetime.now(dt.UTC).isoformat(),
            "receipt": self.receipt(KEY, REPO, digest),
        }

    # --- serving -------------------------------------------------------------------------------

    def requests_to(self, path_prefix: str) -> list[tuple[str, str, dict[str, str]]]:
        return [entry for entry in self.log if entry[1].startswith(path_prefix)]

    def _serve(self, handler: http.server.BaseHTTPRequestHandler, method: str) -> None:
        headers = dict(handler.headers.items())
        body = handler.rfile.read(int(headers.get("Content-Length") or 0))
        path = handler.path
        with self.lock:
            self.log.append((method, path, headers))
        route = self.routes.get((method, path.split("?")[0]))
        if route is None:
            answer = json_answer({"error": {"code": "NOT_FOUND", "message": "Not Found", "detail": {}}}, status=404)
        else:
            answer = route(body, headers) if callable(route) else route
        handler.close_connection = True
        try:
            with contextlib.suppress(OSError):
                self._write(handler, path, answer)
        finally:
            with self.answered:
                self.finished[path] = self.finished.get(path, 0) + 1
                self.answered.notify_all()

    def sent_to(self, path: str, answers: int = 1, timeout_s: float = 10.0) -> int:
        """The bytes sent on ``path`` once ``answers`` answers there have ended: a client that
        hangs up returns before the server's write fails, so reading ``sent`` at once would race it."""
        with self.answered:
            if not self.answered.wait_for(lambda: self.finished.get(path, 0) >= answers, timeout_s):
                raise TimeoutError(f"{answers} answers on {path} did not end within {timeout_s}s")
            return self.sent.get(path, 0)

    def _write(self, handler, path: str, answer: Answer) -> None:
        chunks = [answer.body] if isinstance(answer.body, bytes) else answer.body()
        if answer.length is None:
            assert isinstance(answer.body, bytes), "a lazy body states its length or none"
            answer.length = len(answer.body)
        lines = [f"HTTP/1.1 {answer.status} {http.HTTPStatus(answer.status).phrase}", "Connection: close"]
        lines += [f"{name}: {value}" for name, value in answer.headers.items()]
        if answer.length is not False:
            lines.append(f"Content-Length: {answer.length}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode()
        offset, trickle_from = 0, 0 if answer.trickle_head else len(head)
        for chunk in _chained(head, chunks):
            for piece in _pieces(chunk, offset, answer.trickle_s, trickle_from):
                if answer.trickle_s is not None and offset >= trickle_from:
                    time.sleep(answer.trickle_s)
                handler.wfile.write(piece)
                handler.wfile.flush()
                offset += len(piece)
                with self.lock:
                    self.sent[path] = self.sent.get(path, 0) + len(piece)


def _chained(head: bytes, chunks: Iterable[bytes]) -> Iterator[bytes]:
    yield head
    yield from chunks


def _pieces(chunk: bytes, offset: int, trickle_s: float | None, trickle_from: int) -> Iterator[bytes]:
    """The chunk as written: a byte at a time where the answer trickles, else whole."""
    if trickle_s is None or offset + len(chunk) <= trickle_from:
        yield chunk
        return
    cut = max(0, trickle_from - offset)
    if cut:
        yield chunk[:cut]
    for i in range(cut, len(chunk)):
        yield chunk[i : i + 1]
