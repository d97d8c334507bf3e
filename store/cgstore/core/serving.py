"""How the store is served: uvicorn with bounded headers, header-read time and connections.

uvicorn bounds neither the size of a request's headers (on its httptools
protocol) nor the time a connection may take to send them, so one slow client
per connection could hold connections forever. ``BoundedHttpToolsProtocol``
adds both bounds; ``server_options`` is the one place ``cgstore serve`` and the
test harness take uvicorn's options from, so tests run what production runs.

Answers given here, before the app sees a request, still use the protocol's
JSON error body: 431 ``TOO_LARGE`` for oversized headers, 408
``REQUEST_TIMEOUT`` for headers not received in time, 503 ``UNAVAILABLE`` over
the connection limit, 400 ``BAD_REQUEST`` for a request that is not HTTP; each
closes the connection.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import os
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from cgstore.core.errors import BadRequest, HeadersTooLarge, RequestTimeout, StoreError, Unavailable, error_body
from cgstore.settings import Settings


class _HeadersTooLarge(Exception):
    """Raised from a parser callback: httptools then stops parsing and uvicorn answers the error."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a limit on header bytes and on the time to send them."""

    def __init__(self, *args: Any, max_header_bytes: int, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._max_header_bytes = max_header_bytes
        self._header_timeout_s = header_timeout_s
        self._header_bytes = 0
        self._headers_too_large = False
        self._header_timer = None

    # -- the clock: from the connection (or the request's first byte) to the end of its headers
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        if self._header_timer is None:  # a keep-alive connection's next request
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        if self.limit_concurrency is not None and (
            len(self.connections) >= self.limit_concurrency or len(self.tasks) >= self.limit_concurrency
        ):
            # uvicorn's own answer to this (``limit_concurrency``) is plain text.
            self._answer_and_close(Unavailable("the store is serving all the connections it may; retry later"))
            return
        super().on_headers_complete()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self._header_timeout_s, self._headers_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self._answer_and_close(RequestTimeout("request headers were not received in time"))

    # -- the size: request line plus headers
    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def _count(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self._max_header_bytes:
            self._headers_too_large = True
            raise _HeadersTooLarge

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to anything the parser refused, in the protocol's JSON shape."""
        if self._headers_too_large:
            limit = self._max_header_bytes
            self._answer_and_close(HeadersTooLarge(f"request headers over {limit} bytes", limit=limit))
        else:
            self._answer_and_close(BadRequest("malformed HTTP request"))

    def _answer_and_close(self, err: StoreError) -> None:
        self._disarm_header_timer()
        if self.transport.is_closing():  # already answered; the parser may still call back
            return
        body = json.dumps(error_body(err)).encode()
        head = [
            f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}",
            "content-type: application/json",
            f"content-length: {len(body)}",
            "connection: close",
            *(f"{name}: {value}" for name, value in err.headers().items()),
        ]
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body)
        self.transport.close()


#: ``mallopt`` parameter number of the arena limit (glibc's malloc.h).
_M_ARENA_MAX = -8


def limit_malloc_arenas(arenas: int) -> bool:
    """Cap glibc's malloc arenas at ``arenas`` (0: leave glibc's default); whether a cap was set.

    glibc gives threads arenas of their own, up to 8 per core; each keeps the
    memory its threads freed. With 40 request threads the store's RSS climbed
    ~20% under the first half minute of mixed load and stayed there, while the
    Python heap (tracemalloc) did not grow at all; with 2 arenas it climbs ~6%,
    at the same throughput (bench/load.py). Called before any thread starts;
    an explicit ``MALLOC_ARENA_MAX`` is the operator's choice and wins. Not glibc
    (musl, macOS): nothing to do.
    """
    if arenas == 0 or "MALLOC_ARENA_MAX" in os.environ:
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return mallopt is not None and mallopt(_M_ARENA_MAX, arenas) == 1


def freeze_startup_heap() -> None:
    """Exempt every object alive once the app has started from the garbage collector's full collections.

    Modules, the ORM's mappers, compiled templates, pydantic's validators and
    the app itself live as long as the process; each full (generation 2)
    collection walked them all, a pause in whichever request triggered it.
    Frozen, they are never walked again; objects made later are collected as
    before. In ``bench/console.py`` (2 cores) the slowest answer of a run went
    from 126–217 ms to 76–136 ms; p50 and p95 did not move.
    """
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Undo ``freeze_startup_heap`` when the app stops, so what it froze can be collected again.

    A process that starts and stops several apps (the tests) would otherwise
    keep every stopped app's cyclic garbage for good.
    """
    gc.unfreeze()


def server_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's options for ``settings`` (besides the app, host and port)."""
    return {
        "http": functools.partial(
            BoundedHttpToolsProtocol,
            max_header_bytes=settings.max_header_bytes,
            header_timeout_s=settings.header_timeout_s,
        ),
        "limit_concurrency": settings.max_connections,
        "timeout_keep_alive": settings.keep_alive_timeout_s,
    }
