"""The client's transport: one httpx client for the JSON API, one raw stream for bulk bytes.

- :func:`raise_for_status` is the one place an HTTP answer becomes a typed
  :class:`~cgstore_client.errors.StoreError` carrying the protocol code (as
  huggingface_hub's ``hf_raise_for_status`` does).
- :class:`Retry` is the one retry policy: bounded attempts, exponential backoff
  with full jitter, on connection errors, 429 and 503, honouring ``Retry-After``.
- :class:`Transport` sends API requests through httpx with timeouts and that policy.
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
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar
from urllib.parse import urljoin, urlsplit

import httpx

from cgstore_client.errors import (
    Conflict,
    Denied,
    NotFound,
    Refused,
    StoreError,
    Unauthorized,
    Unavailable,
)

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
        return Unavailable(message, status=status, code=code, detail=detail, retry_after_s=parse_retry_after(retry_after))
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

    def run(self, attempt: Callable[[], T], *, on_retry: Callable[[], None] | None = None) -> T:
        """Call ``attempt`` until it succeeds, raises a non-retryable error, or attempts run out."""
        for failure in range(1, self.attempts + 1):
            try:
                return attempt()
            except Unavailable as err:
                if failure == self.attempts:
                    raise
                time.sleep(self.delay(failure, err.retry_after_s))
                if on_retry is not None:
                    on_retry()
        raise AssertionError("unreachable")  # the loop returns or raises


def unreachable(what: str, err: BaseException) -> Unavailable:
    """A connection-level failure, as the retryable error it is."""
    return Unavailable(f"{what}: {type(err).__name__}: {err}")


class Transport:
    """The JSON API over httpx: base URL, bearer token, timeouts, retries, typed errors."""

    def __init__(self, base_url: str, token: str | None, *, retry: Retry | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.retry = retry or Retry()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, follow_redirects=False)

    def close(self) -> None:
        self._http.close()

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
        """Send one request (retried when ``retry``); ``body`` makes a fresh request body per attempt."""

        def attempt() -> httpx.Response:
            try:
                response = self._http.request(
                    method, path, json=json, params=params, headers=headers, content=body() if body else None
                )
            except httpx.TransportError as err:
                raise unreachable(f"{method} {path}", err) from err
            return raise_for_status(response)

        return self.retry.run(attempt) if retry else attempt()


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


def open_stream(url: str, token: str | None, *, start: int = 0, end: int | None = None) -> Stream:
    """GET ``url`` (bytes ``[start, end)``), following redirects; the token only goes to ``url``'s own host."""
    origin = url
    for _ in range(MAX_REDIRECTS + 1):
        headers = {"Range": f"bytes={start}-{'' if end is None else end - 1}"} if start or end is not None else {}
        if token and same_origin(url, origin):
            headers["Authorization"] = f"Bearer {token}"
        connection, response = _get(url, headers)
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


def _get(url: str, headers: dict[str, str]) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Refused(f"cannot download from {url.split('?')[0]!r}")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=READ_TIMEOUT_S)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        connection.request("GET", target, headers=headers)
        return connection, connection.getresponse()
    except (OSError, http.client.HTTPException) as err:
        connection.close()
        raise unreachable(f"GET {url.split('?')[0]}", err) from err


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
