"""Blob downloads into an open temp file: one verified stream, or parallel ranged GETs.

Why parallel: an object store serves each connection at a bounded rate, so a
worker booting from multi-GiB blobs over one stream waits on that rate, not on
its link. A blob of known size larger than one part (``part_bytes``, 16 MiB by
default) is fetched as ``Range`` parts over up to ``connections`` (8) at once.

- **One bound per client.** :class:`Slots` is a pool of read buffers, one per
  connection, shared by every blob of a client: a connection is opened only while
  holding a buffer, so three blobs never open three times the bound, and memory
  is that many buffers whatever the blob sizes (bytes go socket → buffer → file
  with one ``os.pwrite`` of the whole buffer at its offset; no part is ever held in memory).
- **Off the GIL, in the cache.** One ``readinto`` fills a buffer from the socket and one
  ``pwrite`` empties it, both without the GIL, so the Python-level work is a few calls per
  buffer. A buffer is 256 KiB (``BUFFER_BYTES``, at most a part): small enough to stay in a
  core's L2 cache between the two copies (on the bench machine, against RGW and through the
  network model, buffers of 1-4 MiB cost 1.5-3x the CPU per byte of 128-256 KiB ones, and
  512 KiB now and then). blake3 hashes without the GIL too (and on several threads for a
  large window).
- **Verification is not weakened.** The whole file is hashed (blake3) and sized
  before the caller renames it. The hash follows the lowest incomplete offset while
  later parts still arrive, over a read-only mapping of what the parts wrote (no copy
  back out of the page cache), so when the last part lands only the tail is left to
  hash. Behind the hash the kernel is asked to start writing the prefix back, so the
  caller's fsync waits for the tail only.
- **Faults.** A failed part is retried alone from where it stopped (the client's
  :class:`~cgstore_client.worker.http.Retry` policy); a server answering 200 to a ranged
  request, or a Content-Range other than the one asked, makes the whole blob
  fall back to one stream; a redirect target (a presigned URL) that starts
  refusing (expired mid-download) is resolved again through the store, once.
- The store is asked once per blob: the first part follows its redirect and the
  other parts go straight to where it led (the token only to the store's host).
- **Bounds** (``cgstore_client.limits``). A blob's bytes never pass the size the
  record states (or ``max_blob_bytes`` when none is stated): a declared length past
  it is refused before reading, a body past it stops at the bound. A blob's download
  keeps a minimum throughput (:class:`Floor`) over all its connections, so a server
  that serves a byte per connection, honouring ``Range``, ends the download rather
  than being followed reconnect after reconnect.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

import blake3

from cgstore_client.errors import DeadlineExceeded, Denied, IntegrityError, Refused, TooLarge, Unauthorized, Unavailable
from cgstore_client.limits import Limits
from cgstore_client.worker.cache import Cache
from cgstore_client.worker.http import READ_TIMEOUT_S, Retry, Stream, open_stream, same_origin

#: As ``aria2c -x16``: at C = 32 MiB/s a link of A = 256 MiB/s and above needs more than 8
#: connections to fill (``bench/boot_network.py``: 8 gave 0.86 of aria2c, 16 gave 1.01).
DEFAULT_CONNECTIONS = 16
DEFAULT_PART_BYTES = 16 << 20
#: One connection's buffer: large enough that the per-call work in Python is small against the
#: bytes moved, small enough to stay in a core's L2 cache from the socket's copy to the file's.
BUFFER_BYTES = 256 << 10
#: The most of the file the prefix hash maps at once.
HASH_WINDOW_BYTES = 64 << 20

Progress = Callable[[int], None]


class Slots:
    """The client-wide bound on open download connections: a pool of read buffers, one per connection."""

    def __init__(self, connections: int, buffer_bytes: int = BUFFER_BYTES) -> None:
        self.connections, self.buffer_bytes = connections, buffer_bytes
        self._free: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        for _ in range(connections):
            self._free.put(None)  # allocated on first use: an idle client holds no buffer

    @contextlib.contextmanager
    def take(self) -> Iterator[memoryview]:
        buffer = self._free.get() or memoryview(bytearray(self.buffer_bytes))
        try:
            yield buffer
        finally:
            self._free.put(buffer)


@dataclass(frozen=True)
class Plan:
    """How a client downloads: the shared connection slots, the part size, retries, bounds."""

    slots: Slots
    part_bytes: int
    retry: Retry
    cache: Cache
    limits: Limits


class Floor:
    """One blob download's minimum throughput: at least ``min_bytes_per_s`` over every window of
    ``throughput_window_s`` of *busy* time, counting the bytes of all its connections.

    Busy is while at least one of its connections is open or pausing before a retry (:meth:`busy`);
    waiting for one of the client's connection slots (another blob holds them all) is not, so a
    blob queued behind others is never judged on time it could not use.
    """

    def __init__(self, limits: Limits, what: str) -> None:
        self.rate, self.window_s, self.what = limits.min_bytes_per_s, limits.throughput_window_s, what
        self.bytes, self.busy_s, self.active, self.busy_since = 0, 0.0, 0, 0.0
        self.lock = threading.Lock()

    @property
    def timeout_s(self) -> float:
        """How long one connection may stay silent: a window at most."""
        return min(READ_TIMEOUT_S, self.window_s)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        with self.lock:
            if self.active == 0:
                self.busy_since = time.monotonic()
            self.active += 1
        try:
            yield
        finally:
            with self.lock:
                self.active -= 1
                if self.active == 0:
                    self.busy_s += time.monotonic() - self.busy_since

    def add(self, n: int) -> None:
        with self.lock:
            self.bytes += n
        self.check()

    def check(self) -> None:
        """Raise :class:`DeadlineExceeded` when the window that just closed was below the floor."""
        with self.lock:
            now = time.monotonic()
            busy = self.busy_s + (now - self.busy_since if self.active else 0.0)
            if busy < self.window_s:
                return
            if self.bytes < self.rate * busy:
                raise DeadlineExceeded(
                    f"{self.what}: {self.bytes} bytes in {busy:.1f} s, below the client's minimum of "
                    f"{self.rate} bytes/s (CGSTORE_MIN_BYTES_PER_S over CGSTORE_THROUGHPUT_WINDOW_S)"
                )
            self.bytes, self.busy_s, self.busy_since = 0, 0.0, now


def download(
    plan: Plan, url: str, token: str | None, size: int | None, out: BinaryIO, progress: Progress | None
) -> tuple[str, int]:
    """Download ``url`` into ``out`` (an empty file); (blake3 digest, byte count) of what it holds.

    Raises :class:`TooLarge` past ``size`` (``max_blob_bytes`` when None) and
    :class:`DeadlineExceeded` below the minimum throughput.
    """
    floor = Floor(plan.limits, f"the download of {url.split('?')[0].rsplit('/', 1)[-1]}")
    if size is not None and size > plan.part_bytes and plan.slots.connections > 1:
        try:
            return _Parallel(
                plan, _Source(url, token, size, floor.timeout_s), size, out.fileno(), progress, floor
            ).run()
        except _RangesIgnored:
            out.seek(0)
            out.truncate()
    return _Single(plan, url, token, size, out, progress, floor).run()


class _Single:
    """One stream: resumes with ``Range`` after a dropped connection, restarts on a 200."""

    def __init__(
        self,
        plan: Plan,
        url: str,
        token: str | None,
        size: int | None,
        out: BinaryIO,
        progress: Progress | None,
        floor: Floor,
    ) -> None:
        self.plan, self.url, self.token, self.size, self.out, self.progress = plan, url, token, size, out, progress
        self.floor = floor
        self.bound = size if size is not None else plan.limits.max_blob_bytes
        self.hasher = _hasher()
        self.have = 0

    def run(self) -> tuple[str, int]:
        failures = 0
        while True:
            before = self.have
            try:
                self.floor.check()
                with self.plan.slots.take() as buffer, self.floor.busy():
                    self._attempt(buffer)
                return "blake3:" + self.hasher.hexdigest(), self.have
            except DeadlineExceeded:
                raise
            except Unavailable as err:
                # Attempts count only failures without progress: a flaky link that keeps
                # delivering bytes is followed to the end (within the floor), a dead one is given up on.
                failures = 1 if self.have > before else failures + 1
                if failures >= self.plan.retry.attempts:
                    raise
                with self.floor.busy():
                    time.sleep(self.plan.retry.delay(failures, err.retry_after_s))

    def _attempt(self, buffer: memoryview) -> None:
        stream = open_stream(self.url, self.token, start=self.have, timeout_s=self.floor.timeout_s)
        try:
            self._check_span(stream)
            self._copy(stream, buffer)
            stream.finish()
        finally:
            stream.close()

    def _check_span(self, stream: Stream) -> None:
        if stream.start != self.have:
            if stream.start != 0:
                raise Refused(f"asked for bytes from {self.have}, got a range from {stream.start}")
            self._restart()  # a 200 to a ranged request: the whole body again, from scratch
        if stream.total is not None:
            _check_total(stream, self.size)
            if stream.total > self.bound:
                raise TooLarge(
                    f"the server serves {stream.total} bytes, more than the bound of {self.bound} "
                    f"({self._bound_name()}); nothing was read"
                )
            if self.have == 0:
                self.plan.cache.require_space(stream.total)

    def _restart(self) -> None:
        self.out.seek(0)
        self.out.truncate()
        self.hasher = _hasher()
        self.have = 0

    def _copy(self, stream: Stream, buffer: memoryview) -> None:
        # Never asks for more than one byte past the bound: a body that goes on is cut there.
        while n := stream.readinto(buffer[: min(len(buffer), self.bound - self.have + 1)]):
            if self.have + n > self.bound:
                raise TooLarge(f"more than the {self._bound_name()} of {self.bound} bytes; reading stopped there")
            chunk = buffer[:n]
            self.hasher.update(chunk)
            self.out.write(chunk)
            self.have += n
            if self.progress is not None:
                self.progress(n)
            self.floor.add(n)

    def _bound_name(self) -> str:
        if self.size is not None:
            return "expected size"
        return "client's bound on a blob of unstated size (CGSTORE_MAX_BLOB_BYTES)"


def _check_total(stream: Stream, size: int | None) -> None:
    if stream.total is not None and size is not None and stream.total != size:
        stream.close()
        error = TooLarge if stream.total > size else IntegrityError
        raise error(f"the store serves {stream.total} bytes, expected {size}; nothing was read")


class _RangesIgnored(Exception):
    """The server answered a part with other bytes than asked: download the blob as one stream."""


class _Source:
    """Where parts come from: the store's blob URL, and where its redirect led (a presigned URL)."""

    def __init__(self, url: str, token: str | None, size: int, timeout_s: float) -> None:
        self.url, self.token, self.size, self.timeout_s = url, token, size, timeout_s
        self.resolved: str | None = None
        self.renewed = False
        self.ignored = False  # a part got other bytes than asked: the others need not ask
        self.lock = threading.Lock()

    def open(self, start: int, end: int) -> Stream:
        """A stream of bytes ``[start, end)``, exactly those, or :class:`_RangesIgnored`."""
        with self.lock:  # the first part asks the store; the others wait for where it leads
            if self.ignored:
                raise _RangesIgnored("the server ignores ranges")
            if self.resolved is None:
                stream = open_stream(self.url, self.token, start=start, end=end, timeout_s=self.timeout_s)
                self.resolved = stream.url
                return self._checked(stream, start, end)
            url = self.resolved
        try:
            stream = open_stream(
                url, self.token if same_origin(url, self.url) else None, start=start, end=end, timeout_s=self.timeout_s
            )
        except (Denied, Unauthorized):
            if not self._renew(url):
                raise
            return self.open(start, end)
        return self._checked(stream, start, end)

    def _renew(self, refused: str) -> bool:
        """Whether to ask again after ``refused`` denied a part: a presigned URL expires, once per download."""
        with self.lock:
            if self.resolved != refused:
                return True  # another part already renewed it
            if self.renewed or refused == self.url:
                return False  # the store itself refuses: that answer stands
            self.renewed, self.resolved = True, None
            return True

    def _checked(self, stream: Stream, start: int, end: int) -> Stream:
        _check_total(stream, self.size)
        if (stream.start, stream.end) != (start, end):
            self.ignored = True
            stream.close()
            raise _RangesIgnored(f"asked for bytes {start}-{end - 1}, got {stream.start}-{stream.end}")
        return stream


@dataclass
class _Part:
    start: int
    end: int
    have: int = 0  # bytes written from ``start``

    @property
    def next(self) -> int:
        return self.start + self.have


class _Parallel:
    """A blob of known size as ranged parts over the client's connection slots, hashed as its prefix grows."""

    def __init__(
        self, plan: Plan, source: _Source, size: int, fd: int, progress: Progress | None, floor: Floor
    ) -> None:
        self.plan, self.source, self.size, self.fd, self.progress = plan, source, size, fd, progress
        self.floor = floor
        self.parts = [_Part(start, min(start + plan.part_bytes, size)) for start in range(0, size, plan.part_bytes)]
        self.todo = iter(self.parts)
        self.changed = threading.Condition()  # the hashed-to part advanced, a part failed, or a worker ended
        self.hashed = 0  # where the prefix hash stands: only the part holding this offset wakes it
        self.first_open = 0  # index of the lowest part not yet complete
        self.error: BaseException | None = None
        self.running = 0
        self.progress_lock = threading.Lock()  # the hook is never called from two threads at once

    def run(self) -> tuple[str, int]:
        workers = min(self.plan.slots.connections, len(self.parts))
        self.running = workers
        with ThreadPoolExecutor(workers, thread_name_prefix="cgstore-part") as pool:
            for _ in range(workers):
                pool.submit(self._work)
            try:
                return self._hash_prefix(), self.size
            except BaseException as err:
                self._fail(err)  # stop the workers before the pool waits for them
                raise

    def _hash_prefix(self) -> str:
        """blake3 of the file, over a mapping of the prefix written so far, as parts land."""
        hasher = _hasher()
        while self.hashed < self.size:
            with self.changed:
                while (frontier := self._frontier()) == self.hashed and self.error is None and self.running:
                    self.changed.wait()
                if self.error is not None:
                    raise self.error
                if frontier == self.hashed:
                    raise Unavailable(f"the download stopped at byte {self.hashed} of {self.size}")
            end = min(frontier, self.hashed + HASH_WINDOW_BYTES)
            _hash_range(hasher, self.fd, self.hashed, end)
            _start_writeback(self.fd, self.hashed, end - self.hashed)
            with self.changed:
                self.hashed = end
        return "blake3:" + hasher.hexdigest()

    def _frontier(self) -> int:
        """The end of the contiguous prefix written (parts write in order from their start); under ``changed``."""
        while self.first_open < len(self.parts) and self.parts[self.first_open].next == self.parts[self.first_open].end:
            self.first_open += 1
        return self.parts[self.first_open].next if self.first_open < len(self.parts) else self.size

    def _work(self) -> None:
        try:
            while self.error is None and (part := self._next_part()) is not None:
                self._fetch(part)
        except BaseException as err:
            self._fail(err)
        finally:
            with self.changed:
                self.running -= 1
                self.changed.notify_all()

    def _next_part(self) -> _Part | None:
        with self.changed:
            return next(self.todo, None)

    def _fail(self, err: BaseException) -> None:
        with self.changed:
            self.error = self.error or err
            self.changed.notify_all()

    def _fetch(self, part: _Part) -> None:
        """One part, retried alone from where it stopped."""
        failures = 0
        while part.next < part.end and self.error is None:
            before = part.have
            try:
                self.floor.check()
                with self.plan.slots.take() as buffer, self.floor.busy():
                    self._attempt(part, buffer)
            except DeadlineExceeded:
                raise
            except Unavailable as err:
                failures = 1 if part.have > before else failures + 1
                if failures >= self.plan.retry.attempts:
                    raise
                with self.floor.busy():
                    time.sleep(self.plan.retry.delay(failures, err.retry_after_s))

    def _attempt(self, part: _Part, buffer: memoryview) -> None:
        if self.error is not None:
            return  # the download failed while this part waited for a connection
        stream = self.source.open(part.next, part.end)
        try:
            # At most one byte past the part: a body longer than its Content-Range never overwrites the next part.
            while self.error is None and (n := stream.readinto(buffer[: min(len(buffer), part.end - part.next + 1)])):
                if part.next + n > part.end:
                    raise TooLarge(
                        f"bytes {part.start}-{part.end - 1} came with more than {part.end - part.start} bytes"
                    )
                _pwrite(self.fd, buffer[:n], part.next)
                with self.changed:
                    part.have += n
                    if part.start <= self.hashed < part.end:  # the part the hash waits for: wake it
                        self.changed.notify_all()
                if self.progress is not None:
                    with self.progress_lock:
                        self.progress(n)
                self.floor.add(n)
            if self.error is None:
                stream.finish()
        finally:
            stream.close()


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _hasher() -> blake3.blake3:
    # Several threads for a large update (a window of the prefix); the GIL is released either way.
    return blake3.blake3(max_threads=blake3.blake3.AUTO)


def _hash_range(hasher: blake3.blake3, fd: int, start: int, end: int) -> None:
    """Hash bytes ``[start, end)`` of ``fd`` (all written) from a read-only mapping: no copy out of the page cache."""
    base = start - start % mmap.ALLOCATIONGRANULARITY
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault the window in with one call
    try:
        mapped = mmap.mmap(fd, end - base, flags=flags, prot=mmap.PROT_READ, offset=base)
    except OSError:  # a file system that cannot map files: read the bytes back instead
        _hash_read_back(hasher, fd, start, end)
        return
    with mapped, memoryview(mapped)[start - base :] as view:
        hasher.update(view)


def _hash_read_back(hasher: blake3.blake3, fd: int, start: int, end: int) -> None:
    buffer = memoryview(bytearray(min(BUFFER_BYTES, end - start)))
    while start < end:
        n = os.preadv(fd, [buffer[: min(len(buffer), end - start)]], start)
        if n == 0:
            raise IntegrityError(f"the temp file ends at {start}, before the {end} bytes written to it")
        hasher.update(buffer[:n])
        start += n


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """Linux's ``sync_file_range`` (the standard library has no binding); None elsewhere.

    Looked up among the symbols the process already has (libc), not with ``find_library``,
    which runs ``ldconfig`` in a subprocess: importing the client stays cheap.
    """
    with contextlib.suppress(OSError, AttributeError, TypeError):
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
        function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        return function
    return None


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, start: int, length: int) -> None:
    """Ask the kernel to start writing bytes already hashed back to disk (without waiting), so the
    fsync before the rename finds most of the file clean. Only a head start: the fsync stays."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, start, length, _SYNC_FILE_RANGE_WRITE)
