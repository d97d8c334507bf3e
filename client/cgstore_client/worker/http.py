"""The client's transport: one httpx client for the JSON API, one raw stream for bulk bytes.

- :func:`raise_for_status` is the one place an HTTP answer becomes a typed
  :class:`~cgstore_client.errors.StoreError` carrying the protocol code (as
  huggingface_hub's ``hf_raise_for_status`` does).
- :class:`Retry` is the one retry policy: bounded attempts, exponential backoff
  with full jitter, on connection errors, 429 and 503, honouring ``Retry-After``.
- :class:`Transport` sends API requests through httpx with timeouts and that policy, and holds
  each call to the client's :class:`~cgstore_client.limits.Limits`: an overall :class:`Deadline`
  that every socket operation honours (a trickled answer cannot stretch a call past it), and a
  bound on the answer body, read as a stream. It sends only to the store's own origin, so the
  token never leaves it whatever path or URL an answer names.
- :func:`open_stream` opens a blob body (or a byte range of it) with the standard library's
  ``http.client``: bulk bytes are read with ``readinto`` straight from the socket
  into one reused buffer, which is what lets a verified download keep up with a
  raw boto3 GET (httpx's 64 KiB reads and chunk copies cost a third of that).
  It follows redirects itself so that the cap-token never travels to another host.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar
from urllib.parse import quote, urljoin, urlsplit

import httpcore
import httpx

from cgstore_client.errors import (
    ConfigError,
    Conflict,
    DeadlineExceeded,
    Denied,
    KeyInvalid,
    NotFound,
    Refused,
    StoreError,
    TooLarge,
    Unauthorized,
    Unavailable,
)
from cgstore_client.keys import validate_key
from cgstore_client.limits import Limits

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
MAX_REDIRECTS = 3
MAX_ERROR_BODY = 64 * 1024
#: A server asking for a longer pause than this is treated as down for this attempt.
MAX_RETRY_AFTER_S = 60.0
REDIRECTS = frozenset({301, 302, 303, 307, 308})

_BY_STATUS: dict[int, type[StoreError]] = {401: Unauthorized, 403: Denied, 404: NotFound, 409: Conflict}

T = TypeVar("T")


def error_for(status: int, body: bytes, retry_after: str | None = None) -> StoreError:
    """The typed error for an answer ``status`` with error body ``body`` (docs/protocol.md "Errors")."""
    code, message, detail = None, f"HTTP {status}", {}
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        error = json.loads(body)["error"]
        code, message, detail = str(error["code"]), str(error["message"]), dict(error.get("detail") or {})
    if status in (429, 503) or code == "UNAVAILABLE":
        return Unavailable(
            message, status=status, code=code, detail=detail, retry_after_s=parse_retry_after(retry_after)
        )
    cls = _BY_STATUS.get(status, Refused if 400 <= status < 500 else Unavailable)
    if cls is Unavailable:  # any other 5xx: a server fault, worth another attempt
        return Unavailable(message, status=status, code=code, detail=detail)
    return cls(message, status=status, code=code, detail=detail)


def raise_for_status(response: httpx.Response) -> httpx.Response:
    """Return ``response`` when it is a success, else raise its typed error."""
    if response.is_success:
        return response
    raise error_for(response.status_code, response.content[:MAX_ERROR_BODY], response.headers.get("retry-after"))


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds: delta-seconds or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    with contextlib.suppress(TypeError, ValueError, OverflowError):
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    return None


@dataclass(frozen=True)
class Retry:
    """Bounded retries with exponential backoff and full jitter."""

    attempts: int = 5
    base_s: float = 0.2
    cap_s: float = 10.0

    def delay(self, failure: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait before attempt ``failure + 1`` (``failure`` counts from 1)."""
        if retry_after_s is not None:
            return min(retry_after_s, MAX_RETRY_AFTER_S)
        return random.uniform(0, min(self.cap_s, self.base_s * 2 ** (failure - 1)))

    def run(
        self, attempt: Callable[[], T], *, on_retry: Callable[[], None] | None = None, deadline: Deadline | None = None
    ) -> T:
        """Call ``attempt`` until it succeeds, raises a non-retryable error, or attempts (or ``deadline``) run out."""
        for failure in range(1, self.attempts + 1):
            try:
                return attempt()
            except DeadlineExceeded:
                raise  # the call's time is spent: another attempt has none
            except Unavailable as err:
                if failure == self.attempts:
                    raise
                pause = self.delay(failure, err.retry_after_s)
                if deadline is not None and pause >= deadline.remaining():
                    raise deadline.exceeded(err) from err
                time.sleep(pause)
                if on_retry is not None:
                    on_retry()
        raise AssertionError("unreachable")  # the loop returns or raises


def unreachable(what: str, err: BaseException) -> Unavailable:
    """A connection-level failure, as the retryable error it is."""
    return Unavailable(f"{what}: {type(err).__name__}: {err}")


def store_path(*segments: str) -> str:
    """``/seg/seg/...`` with each segment percent-encoded: names from an answer stay inside their segment."""
    for segment in segments:
        if not isinstance(segment, str) or segment in ("", ".", ".."):
            raise Refused(f"not a path segment: {str(segment)[:100]!r}")
    # RFC 3986 pchar stays as is ("blake3:<hex>" is one segment); "/", "?", "#" and "%" are encoded.
    return "".join("/" + quote(segment, safe=":@!$&'()*+,;=") for segment in segments)


def split_repo(repo: str) -> tuple[str, str]:
    """``owner/name`` as its two names; anything else is a :class:`ConfigError`."""
    owner, sep, name = repo.partition("/")
    if not sep or not owner or not name or "/" in name:
        raise ConfigError(f"a repo is 'owner/name', not {repo!r}")
    return owner, name


def record_path(repo: object, key: object) -> str:
    """The store's path of ``repo``'s record ``key``, built here from the two names (never an answer's ``href``)."""
    try:
        owner, name = split_repo(repo if isinstance(repo, str) else "")
        validate_key(key)
    except (ConfigError, KeyInvalid) as err:  # names from an answer: the store's fault, not the configuration's
        raise Refused(f"the store's answer names no record the client can read: {err}") from None
    return store_path("v1", "repos", owner, name, "compiled-graphs", key)


def parse_answer(model, content: bytes):
    """An answer body parsed with its wire type; a body that breaks the protocol is a typed refusal."""
    try:
        return model.model_validate_json(content)
    except ValueError as err:  # pydantic's ValidationError is a ValueError
        raise Refused(f"the store's answer is not a {model.__name__}: {err}") from None


# --- deadlines -------------------------------------------------------------------------------

_CURRENT = threading.local()  # .at: the monotonic deadline of this thread's API call, while one runs


class Deadline:
    """One API call's overall deadline. While :meth:`applied`, every socket operation of this thread's
    API requests (connect, each write, each read) waits at most until it, so an answer trickled a byte
    at a time (its headers included) ends the call at the deadline, not at the next read timeout."""

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds, self.what = seconds, what
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def exceeded(self, last: BaseException | None = None) -> DeadlineExceeded:
        why = f" (last: {last})" if last is not None else ""
        return DeadlineExceeded(
            f"{self.what} took longer than the client's deadline of {self.seconds:g} s (CGSTORE_CALL_DEADLINE_S){why}"
        )

    def check(self) -> None:
        if self.remaining() <= 0:
            raise self.exceeded()

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        previous = getattr(_CURRENT, "at", None)
        _CURRENT.at = self.at
        try:
            yield
        finally:
            _CURRENT.at = previous


def _within_deadline(timeout: float | None, expired: type[Exception]) -> float | None:
    """A socket operation's timeout, cut to what is left of the current call's deadline."""
    at = getattr(_CURRENT, "at", None)
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        raise expired("the call's deadline has passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _within_deadline(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _within_deadline(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> httpcore.NetworkStream:
        return _DeadlineStream(
            self._stream.start_tls(ssl_context, server_hostname, _within_deadline(timeout, httpcore.ConnectTimeout))
        )

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's socket backend, each operation held to the calling thread's :class:`Deadline`; it keeps
    its open streams so :meth:`abort` can end a call blocked on another thread (a long-poll) at once."""

    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()
        self._open: weakref.WeakSet[_DeadlineStream] = weakref.WeakSet()
        self._lock = threading.Lock()

    def _kept(self, stream: httpcore.NetworkStream) -> _DeadlineStream:
        kept = _DeadlineStream(stream)
        with self._lock:
            self._open.add(kept)
        return kept

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        timeout = _within_deadline(timeout, httpcore.ConnectTimeout)
        return self._kept(self._backend.connect_tcp(host, port, timeout, local_address, socket_options))

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        timeout = _within_deadline(timeout, httpcore.ConnectTimeout)
        return self._kept(self._backend.connect_unix_socket(path, timeout, socket_options))

    def abort(self) -> None:
        """Shut every open socket down: a read blocked on another thread returns now (closing the file
        descriptor alone would leave it blocked until the server answers)."""
        with self._lock:
            streams = list(self._open)
        for stream in streams:
            sock = stream.get_extra_info("socket")
            with contextlib.suppress(OSError, AttributeError):
                sock.shutdown(socket.SHUT_RDWR)

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


_HTTPCORE_ERRORS = (
    httpcore.TimeoutException,
    httpcore.NetworkError,
    httpcore.ProtocolError,
    httpcore.UnsupportedProtocol,
    httpcore.ConnectionNotAvailable,
)


@contextlib.contextmanager
def _as_httpx_errors() -> Iterator[None]:
    try:
        yield
    except _HTTPCORE_ERRORS as err:
        # httpx names its errors as httpcore does (ConnectError, ReadTimeout, ...): keep the name.
        raise getattr(httpx, type(err).__name__, httpx.TransportError)(str(err)) from err


class _Body(httpx.SyncByteStream):
    def __init__(self, stream: Iterable[bytes]) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        with _as_httpx_errors():
            yield from self._stream

    def close(self) -> None:
        if hasattr(self._stream, "close"):
            self._stream.close()


class _DeadlineTransport(httpx.BaseTransport):
    """httpx over an httpcore connection pool on :class:`_DeadlineBackend` (what httpx's own transport
    does, with sockets that honour the call's deadline)."""

    def __init__(self) -> None:
        defaults = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)  # httpx's
        self._backend = _DeadlineBackend()
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(),
            max_connections=defaults.max_connections,
            max_keepalive_connections=defaults.max_keepalive_connections,
            keepalive_expiry=defaults.keepalive_expiry,
            network_backend=self._backend,
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        core = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _as_httpx_errors():
            answer = self._pool.handle_request(core)
        return httpx.Response(
            answer.status, headers=answer.headers, stream=_Body(answer.stream), extensions=answer.extensions
        )

    def close(self) -> None:
        self._backend.abort()  # calls in flight on other threads end now, not when their answers come
        self._pool.close()


# --- the API transport -----------------------------------------------------------------------

# Headers describing the body as sent: the body handed on is the decoded one.
_BODY_ENCODING_HEADERS = frozenset({"content-encoding", "content-length", "transfer-encoding"})


class Transport:
    """The JSON API over httpx: base URL, bearer token, deadlines, bounded answers, retries, typed errors."""

    def __init__(
        self, base_url: str, token: str | None, *, retry: Retry | None = None, limits: Limits | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.retry = retry or Retry()
        self.limits = limits or Limits()
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        # No default Authorization header: it is added per request, once the target is known to be the store.
        # Identity bodies: the answer bound then counts what was sent, not what a few compressed bytes inflate to.
        # No environment proxies (trust_env): every call goes through the deadline transport, as blobs go direct.
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=timeout,
            follow_redirects=False,
            trust_env=False,
            headers={"Accept-Encoding": "identity"},
            transport=_DeadlineTransport(),
        )

    def close(self) -> None:
        """Close the connections, ending any call in flight on another thread (it raises
        :class:`Unavailable`); a request after this one is refused before anything is sent."""
        self._http.close()

    def url_of(self, path: str) -> str:
        """The absolute URL of ``path`` (a path on the store, or a URL on its origin); anything else is refused.

        The one gate between an answer-supplied location (a record's ``href``, an upload's
        ``Location``) and the bearer token: the token only ever goes to the store's own origin.
        """
        url = self.base_url + path if path.startswith("/") and not path.startswith("//") else path
        if not same_origin(url, self.base_url):
            raise Refused(
                f"refusing to send a request to {_shown(url)!r}: not the store's origin "
                f"({self.base_url}), and the token goes nowhere else"
            )
        return url

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        body: Callable[[], Iterable[bytes] | bytes] | None = None,
        retry: bool = True,
    ) -> httpx.Response:
        """Send one request (retried when ``retry``); ``body`` makes a fresh request body per attempt.

        The whole call, retries included, ends by its :class:`Deadline`
        (:class:`DeadlineExceeded`); an answer body past ``max_answer_bytes`` is :class:`TooLarge`.
        """
        url = self.url_of(path)
        what = f"{method} {_shown(path)}"
        deadline = Deadline(self.limits.call_deadline_s + self._upload_allowance(headers), what)

        def attempt() -> httpx.Response:
            if self._http.is_closed:  # a thread still beating or polling for a client closed meanwhile
                raise Unavailable(f"{what}: the client is closed")
            with deadline.applied():
                deadline.check()
                try:
                    response = self._send(
                        method, url, what, json=json, params=params, headers=headers, content=body() if body else None
                    )
                except httpx.TransportError as err:
                    if deadline.remaining() <= 0:
                        raise deadline.exceeded() from err
                    raise unreachable(what, err) from err
            return raise_for_status(response)

        return self.retry.run(attempt, deadline=deadline) if retry else attempt()

    def _upload_allowance(self, headers: dict[str, str] | None) -> float:
        """Seconds more for a request that uploads a body, at the slowest throughput the client accepts."""
        length = next((v for k, v in (headers or {}).items() if k.lower() == "content-length"), "0")
        return int(length) / self.limits.min_bytes_per_s if length.isdigit() else 0.0

    def _send(self, method: str, url: str, what: str, **options: Any) -> httpx.Response:
        headers = dict(options.pop("headers") or {})
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = self._http.build_request(method, url, headers=headers, **options)
        response = self._http.send(request, stream=True)
        try:
            content = b"" if method == "HEAD" else self._bounded_body(response, what)  # HEAD's length: no body
        finally:
            response.close()
        kept = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _BODY_ENCODING_HEADERS]
        return httpx.Response(response.status_code, headers=kept, content=content, request=request)

    def _bounded_body(self, response: httpx.Response, what: str) -> bytes:
        """The (decoded) answer body, read until it ends or passes ``max_answer_bytes``."""
        bound = self.limits.max_answer_bytes
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > bound:
            raise TooLarge(
                f"the answer to {what} declares {declared} bytes, more than the client's bound of "
                f"{bound} (CGSTORE_MAX_ANSWER_BYTES)"
            )
        chunks, total = [], 0
        for chunk in response.iter_bytes():
            total += len(chunk)
            if total > bound:
                raise TooLarge(
                    f"the answer to {what} is larger than the client's bound of {bound} bytes "
                    "(CGSTORE_MAX_ANSWER_BYTES); reading stopped there"
                )
            chunks.append(chunk)
        return b"".join(chunks)


def _shown(url: str) -> str:
    """A URL or path for a message: without its query (a presigned signature) and cut short."""
    return url.split("?")[0][:200]


@dataclass
class Stream:
    """An open 200 or 206 blob body from ``url`` (after redirects): bytes ``[start, end)`` of a
    blob of ``total`` bytes (``end`` and ``total`` None when the server does not say)."""

    connection: http.client.HTTPConnection
    response: http.client.HTTPResponse
    url: str
    start: int
    end: int | None
    total: int | None

    def readinto(self, buffer: memoryview) -> int:
        try:
            return self.response.readinto(buffer)
        except (OSError, http.client.HTTPException) as err:
            raise unreachable("connection lost mid-download", err) from err

    def finish(self) -> None:
        """Raise (retryably) when the server promised more bytes than it sent."""
        if self.response.length:
            raise Unavailable(f"connection closed {self.response.length} bytes early")

    def close(self) -> None:
        self.connection.close()


def open_stream(
    url: str, token: str | None, *, start: int = 0, end: int | None = None, timeout_s: float = READ_TIMEOUT_S
) -> Stream:
    """GET ``url`` (bytes ``[start, end)``), following redirects; the token only goes to ``url``'s own host.

    Each hop's status line and headers arrive within ``timeout_s`` however they trickle, and
    each later read of the body waits at most ``timeout_s``.
    """
    origin = url
    for _ in range(MAX_REDIRECTS + 1):
        headers = {"Range": f"bytes={start}-{'' if end is None else end - 1}"} if start or end is not None else {}
        if token and same_origin(url, origin):
            headers["Authorization"] = f"Bearer {token}"
        connection, response = _get(url, headers, timeout_s)
        if response.status in REDIRECTS:
            location = response.getheader("Location", "")
            connection.close()
            url = urljoin(url, location)
            continue
        if response.status not in (200, 206):
            try:
                raise error_for(response.status, response.read(MAX_ERROR_BODY), response.getheader("Retry-After"))
            finally:
                connection.close()
        return Stream(connection, response, url, *_span(response))
    raise Refused(f"more than {MAX_REDIRECTS} redirects")


def same_origin(a: str, b: str) -> bool:
    """Whether two URLs name the same scheme, host and port (where a bearer token may go)."""
    return _origin(a) == _origin(b)


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urlsplit(url)
    return parts.scheme, parts.hostname, parts.port


def _get(
    url: str, headers: dict[str, str], timeout_s: float
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Refused(f"cannot download from {url.split('?')[0]!r}")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=timeout_s)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    # The socket timeout bounds each read; headers sent a byte at a time need a bound on the whole.
    watchdog = threading.Timer(timeout_s, _cut, (connection,))
    watchdog.daemon = True
    watchdog.start()
    try:
        connection.request("GET", target, headers=headers)
        return connection, connection.getresponse()
    except (OSError, http.client.HTTPException) as err:
        connection.close()
        raise unreachable(f"GET {url.split('?')[0]}", err) from err
    finally:
        watchdog.cancel()


def _cut(connection: http.client.HTTPConnection) -> None:
    """End a connection whose answer did not start in time (its reader then fails at once)."""
    if connection.sock is not None:
        with contextlib.suppress(OSError):
            connection.sock.shutdown(socket.SHUT_RDWR)


def _span(response: http.client.HTTPResponse) -> tuple[int, int | None, int | None]:
    """(first byte, end, total size) of a 200 or 206 answer."""
    if response.status == 200:
        return 0, response.length, response.length
    content_range = response.getheader("Content-Range", "")
    with contextlib.suppress(ValueError):
        unit, _, rest = content_range.partition(" ")
        span, _, total = rest.partition("/")
        first, _, last = span.partition("-")
        if unit == "bytes":
            return int(first), int(last) + 1, (None if total == "*" else int(total))
    raise Refused(f"unreadable Content-Range {content_range[:100]!r}")


def file_chunks(path: str, start: int, end: int, chunk: int = 1 << 20) -> Iterator[bytes]:
    """Bytes ``[start, end)`` of ``path`` in chunks: a request body that never sits whole in memory."""
    with open(path, "rb") as source:
        source.seek(start)
        left = end - start
        while left > 0:
            data = source.read(min(chunk, left))
            if not data:
                raise Refused(f"{path} is shorter than {end} bytes")
            left -= len(data)
            yield data
