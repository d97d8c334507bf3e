"""Streaming writes to S3: multipart uploads fed from pooled part buffers.

Streaming writes
----------------
``open_write`` goes straight to the final key. Bytes are gathered into parts
of ``part_bytes``; full parts are uploaded as a multipart upload by a small
per-write thread pool, at most ``max_concurrency`` parts in flight (a
semaphore makes ``write`` block while they drain). A multipart upload is
invisible until it is completed: ``publish`` completes it (the verifier above
calls it only after size and digest matched) and ``discard`` aborts it, so
nothing ever appears under ``blobs/`` unverified. A stream that fits one part
never starts a multipart upload: its chunks are kept as they came and sent
with a single ``put_object`` on ``publish``. When the size is known up front,
the part size grows if needed to stay within S3's 10 000-part limit.

Part buffers
------------
Parts are filled (slice assignment, one copy per byte) into buffers of the
full part size taken from a pool owned by the storage (one per process), at
most ``max(8, 2 × max_concurrency)`` of them; a buffer goes back only after
its ``upload_part`` returned, and a writer that needs one while all are lent
waits for one (backpressure, bounded by ``BUFFER_WAIT_S``). Why: a part
buffer grown with ``+=`` and freed in whichever worker thread served the
request stays in that thread's glibc arena, so the server's RSS crept up with
every upload; pooled buffers are allocated once. Memory for part buffers is
therefore at most the pool's bound whatever the number and size of uploads.
A full part is sent as the buffer itself (botocore sends a ``bytearray`` in
place); any shorter body (the last part, a single PUT) goes through
``_ViewsReader``, a seekable file over memoryviews, because botocore refuses a
memoryview body and ``io.BytesIO`` would copy it.

Orphans
-------
A multipart upload left open by a process killed mid-write is reclaimed by
``sweep_orphans`` (a bucket lifecycle rule ``AbortIncompleteMultipartUpload``
does the same and is recommended too). Other processes' uploads are judged by
the store's ``Initiated``; this process's own (``ActiveUploads``) by how long
their writer has been idle, which is exact: an upload being written to, or
with a part or its completion under way, is never aborted, and an idle one
only once idle for ``max(older_than_s, LIVE_WRITER_GRACE_S)`` (the grace keeps
a sweep with a tiny threshold off a live request between two chunks). Why not
``Initiated`` alone: some stores misreport it (moto says 2010 for every
upload), which made each reaper tick abort every upload in flight. Why not
"never ours": a writer this process abandoned (a stuck or leaked request) must
be reclaimed too, like a dead process's.

``CompleteMultipartUpload`` and ``UploadPartCopy`` are the exceptions to short
timeouts: assembling a big object, or copying a part of up to 5 GiB inside S3,
can take longer than the normal read timeout (moto needs 7-11 s to complete
1 GiB), after which botocore would retry a call that already happened. They
therefore run on a second client with ``COMPLETE_READ_TIMEOUT_S``. A part copy
retried is harmless (the same part number from the same source); the complete is
idempotent: if it fails (``NoSuchUpload`` because an earlier attempt finished
it, a 5xx or a timeout after the retries), an object already at the key with
the verified size is accepted. That is sound because every key we complete is
ours alone: blob keys are content-addressed (whoever wrote the object verified
the same bytes) and staged chunk keys carry a random part.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime

from botocore.exceptions import ClientError

from cgstore.core.errors import TooLarge, Unavailable
from cgstore.storage import hashing
from cgstore.storage.hashing import check_session_id
from cgstore.storage.s3.errors import error_code, is_missing, s3_errors
from cgstore.storage.writer import PendingObject

logger = logging.getLogger(__name__)

MiB = 1 << 20
MIN_PART_BYTES = 5 * MiB  # S3's floor for every part but the last
MAX_PARTS = 10_000  # S3's ceiling on parts per multipart upload
# How long a writer waits for a free part buffer before answering Unavailable:
# well above a part upload's worst case (retries × timeouts), so only a store
# overloaded for minutes (or stalled clients holding every buffer) hits it.
BUFFER_WAIT_S = 120.0
CONTENT_TYPE = "application/octet-stream"


class Bucket:
    """The bucket as the driver's parts use it: its clients, the key prefix, the S3 calls of
    single PUTs and multipart uploads, the pool of part buffers and this process's open
    uploads. The driver, the streaming writes and the staged uploads share one; none of
    them reaches into another."""

    def __init__(
        self, client, complete_client, name: str, *, prefix: str, part_bytes: int, max_concurrency: int
    ) -> None:
        self.client = client
        # Only CompleteMultipartUpload and UploadPartCopy may take minutes (see the module docstring).
        self.complete_client = complete_client
        self.name = name
        self.prefix = prefix
        self.part_bytes = part_bytes
        self.max_concurrency = max_concurrency
        self.buffers = PartBuffers(limit=max(8, 2 * max_concurrency), wait_s=BUFFER_WAIT_S)
        self.active = ActiveUploads()

    # -- keys ------------------------------------------------------------------------
    def key(self, relative: str) -> str:
        """The object key of ``relative`` (``blobs/…``, ``uploads/…``) under the prefix."""
        return self.prefix + relative

    def blob_key(self, digest: str) -> str:
        """The object key of the blob ``digest``."""
        return self.key(hashing.blob_key(hashing.parse_digest(digest)))

    def staging_prefix(self, session_id: str) -> str:
        """The prefix of one upload session's staged chunk objects."""
        return self.key(f"uploads/{check_session_id(session_id)}/")

    def part_bytes_for(self, size: int | None) -> int:
        """The configured part size, grown (whole MiB) when a known size needs > 10 000 parts."""
        if size is None:
            return self.part_bytes
        needed = math.ceil(math.ceil(size / MAX_PARTS) / MiB) * MiB
        return max(self.part_bytes, needed)

    # -- objects ---------------------------------------------------------------------------
    def object_size(self, key: str) -> int | None:
        """The size of the object at the full ``key``, or None when there is none."""
        with s3_errors("size"):
            try:
                return self.client.head_object(Bucket=self.name, Key=key)["ContentLength"]
            except ClientError as exc:
                if is_missing(exc):
                    return None
                raise

    def holds(self, key: str, size: int) -> bool:
        """Whether an object of ``size`` bytes is at ``key`` (False when that cannot be told)."""
        try:
            return self.object_size(key) == size
        except Unavailable:  # the caller's own error is the one to report
            return False

    def put(self, key: str, body: bytearray | ViewsReader) -> None:
        with s3_errors("put_object"):
            self.client.put_object(Bucket=self.name, Key=key, Body=body, ContentType=CONTENT_TYPE)

    # -- multipart uploads ---------------------------------------------------------------------
    def create_multipart(self, key: str, liveness: Liveness | None) -> str:
        """Start a multipart upload; one under ``blobs/`` (``liveness`` given) is registered as
        this process's so ``sweep_orphans`` spares it. A session's upload (``liveness`` None)
        outlives the request that created it: its session owns it (``stage_abort``)."""
        with self.active.creating(key), s3_errors("create_multipart_upload"):
            response = self.client.create_multipart_upload(Bucket=self.name, Key=key, ContentType=CONTENT_TYPE)
            upload_id = response["UploadId"]
            # Before leaving creating(): no moment a sweep could take it for an orphan.
            if liveness is not None:
                self.active.add(upload_id, liveness)
        return upload_id

    def upload_part(self, key: str, upload_id: str, part_number: int, body: bytearray | ViewsReader) -> dict:
        with s3_errors("upload_part"):
            response = self.client.upload_part(
                Bucket=self.name, Key=key, UploadId=upload_id, PartNumber=part_number, Body=body
            )
        return {"PartNumber": part_number, "ETag": response["ETag"]}

    def claim(self, key: str) -> bool:
        """Create the empty object ``key`` unless one exists (``If-None-Match: *``): True when
        this call created it. Two callers never both get True (S3 and RGW check it atomically)."""
        with s3_errors("claim"):
            try:
                self.client.put_object(Bucket=self.name, Key=key, Body=b"", IfNoneMatch="*")
            except ClientError as exc:
                # 412: it exists; 409: a concurrent conditional write to it is under way (AWS).
                if error_code(exc)[1] in (409, 412):
                    return False
                raise
        return True

    def copy_object(self, source: str, key: str) -> None:
        """Copy ``source`` (at most 5 GiB) to ``key`` inside S3 (on RGW a reference, not a byte copy)."""
        with s3_errors("copy_object"):
            try:
                self.complete_client.copy_object(
                    Bucket=self.name, Key=key, CopySource={"Bucket": self.name, "Key": source}
                )
            except ClientError as exc:
                if is_missing(exc):
                    raise LookupError(source) from None
                raise

    def complete_multipart(self, key: str, upload_id: str, parts: list[dict], size: int) -> None:
        """Complete, idempotently: an object of the verified ``size`` already at ``key`` is success."""
        try:
            with s3_errors("complete_multipart_upload"):
                self.complete_client.complete_multipart_upload(
                    Bucket=self.name, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                )
        except Unavailable:
            # NoSuchUpload, a 5xx or a timeout after the retries: an earlier attempt
            # may have completed it, its answer lost. Our keys are ours alone
            # (content-addressed or random), so an object of our size is our bytes.
            if not self.holds(key, size):
                raise
            logger.info("completing %s failed, but an earlier attempt had completed it (%d bytes)", key, size)
        self.active.discard(upload_id)

    def list_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, str]]:
        """The uploaded parts of an open upload: number → (size, ETag)."""
        parts = {}
        with s3_errors("list_parts"):
            for page in self.client.get_paginator("list_parts").paginate(Bucket=self.name, Key=key, UploadId=upload_id):
                for part in page.get("Parts", []):
                    parts[part["PartNumber"]] = (part["Size"], part["ETag"])
        return parts

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Abort on an error path: never raise over the original error, but say what leaked."""
        try:
            with s3_errors("abort_multipart_upload"):
                try:
                    self.client.abort_multipart_upload(Bucket=self.name, Key=key, UploadId=upload_id)
                except ClientError as exc:
                    if error_code(exc)[0] != "NoSuchUpload":  # already gone is what we wanted
                        raise
        except (ClientError, Unavailable) as exc:
            logger.warning(
                "abort of multipart upload %s on %s failed (sweep_orphans or stage_abort reclaims it): %s",
                upload_id,
                key,
                exc,
            )
        finally:
            self.active.discard(upload_id)

    def abort_multipart_uploads(
        self, prefix: str, initiated_before: datetime | None = None, spare_idle_s: float | None = None
    ) -> int:
        """Abort the open multipart uploads under ``prefix``; return how many. Optionally
        only those initiated before ``initiated_before``, and sparing this process's own
        unless idle for ``spare_idle_s``."""
        aborted = 0
        with s3_errors("list_multipart_uploads"):
            paginator = self.client.get_paginator("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.name, Prefix=prefix):
                for upload in page.get("Uploads", []):
                    if initiated_before is not None and upload["Initiated"] >= initiated_before:
                        continue
                    if spare_idle_s is not None and self.active.live(upload["Key"], upload["UploadId"], spare_idle_s):
                        continue
                    try:
                        self.client.abort_multipart_upload(
                            Bucket=self.name, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                    except ClientError as exc:
                        if error_code(exc)[0] != "NoSuchUpload":  # raced with its own abort
                            raise
                    aborted += 1
        return aborted


@dataclasses.dataclass
class Liveness:
    """How busy one streaming upload is, and since when it is idle (guarded by
    ``ActiveUploads``' lock)."""

    busy: int = 0  # writes, part uploads and completions under way
    since: float = dataclasses.field(default_factory=time.monotonic)  # when last busy


class ActiveUploads:
    """This process's open multipart uploads and how long each has been idle: what
    ``sweep_orphans`` must not take for an orphan (see "Orphans" above).

    A key is registered *before* CreateMultipartUpload is sent and its upload id
    before the key is let go, so a sweep listing in between still sees the
    upload as ours. Thread-safe: writers, part uploads and the reaper run in
    different threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._uploads: dict[str, Liveness] = {}
        self._creating: collections.Counter[str] = collections.Counter()  # two writers may share a key

    @contextlib.contextmanager
    def creating(self, key: str) -> Iterator[None]:
        with self._lock:
            self._creating[key] += 1
        try:
            yield
        finally:
            with self._lock:
                self._creating[key] -= 1
                if not self._creating[key]:
                    del self._creating[key]

    def add(self, upload_id: str, liveness: Liveness) -> None:
        with self._lock:
            liveness.since = time.monotonic()
            self._uploads[upload_id] = liveness

    def discard(self, upload_id: str) -> None:
        with self._lock:
            self._uploads.pop(upload_id, None)

    @contextlib.contextmanager
    def busy(self, liveness: Liveness) -> Iterator[None]:
        """Mark an upload as worked on meanwhile (its id may not even exist yet)."""
        self._step(liveness, +1)
        try:
            yield
        finally:
            self._step(liveness, -1)

    def _step(self, liveness: Liveness, step: int) -> None:
        with self._lock:
            liveness.busy += step
            liveness.since = time.monotonic()

    def live(self, key: str, upload_id: str, idle_s: float) -> bool:
        """Whether the upload is ours and busy, or idle for less than ``idle_s``."""
        with self._lock:
            if key in self._creating:
                return True
            liveness = self._uploads.get(upload_id)
            return liveness is not None and (liveness.busy > 0 or time.monotonic() - liveness.since < idle_s)


class PartBuffers:
    """Part buffers allocated once at full size and lent out again and again (see
    "Part buffers" in the module docstring).

    At most ``limit`` buffers exist. ``acquire`` reuses an idle buffer of the
    asked size, else allocates one while under the limit, else frees an idle
    buffer of another size (a part size grown for a huge blob) to make room,
    else waits for a ``release``: backpressure. After ``wait_s`` it gives up
    with ``Unavailable``. Deadlock-free because a writer holds at most one
    buffer it is filling and asks for the next only after handing that one to
    an upload, and uploads always give theirs back (their time is bounded by
    the client's timeouts).
    """

    def __init__(self, limit: int, wait_s: float) -> None:
        self.limit = limit
        self.allocated = 0  # idle + lent; never above limit
        self._wait_s = wait_s
        self._idle: list[bytearray] = []
        self._changed = threading.Condition()

    def acquire(self, size: int) -> bytearray:
        deadline = time.monotonic() + self._wait_s
        with self._changed:
            while True:
                for i, buffer in enumerate(self._idle):
                    if len(buffer) == size:
                        return self._idle.pop(i)
                if self.allocated < self.limit:
                    self.allocated += 1
                    break
                if self._idle:  # only buffers of another size are idle: trade one in
                    self._idle.pop()
                    break
                if not self._changed.wait(max(deadline - time.monotonic(), 0)):
                    raise Unavailable("every part buffer is in use; retry later", buffers=self.limit)
        try:
            return bytearray(size)  # outside the lock: zero-filling 16 MiB takes a few ms
        except BaseException:
            with self._changed:
                self.allocated -= 1
                self._changed.notify()
            raise

    def release(self, buffer: bytearray) -> None:
        with self._changed:
            self._idle.append(buffer)
            self._changed.notify()


class ViewsReader:
    """A seekable read-only file over memoryviews, read without copying them first.

    For bodies that are not a whole ``bytearray``: botocore accepts only bytes,
    bytearray or a file as a Body, and ``io.BytesIO`` would copy a memoryview.
    Seekable because botocore reads the body to sign it, then rewinds it, and
    rewinds it again to retry.
    """

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views
        self._starts = list(itertools.accumulate((len(view) for view in views), initial=0))
        self._size = self._starts.pop()
        self._position = 0

    def __len__(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._position, 2: self._size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._position = base + offset
        return self._position

    def read(self, size: int = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._position + size)
        pieces = []
        while self._position < end:
            i = bisect.bisect_right(self._starts, self._position) - 1
            start = self._starts[i]
            piece = self._views[i][self._position - start : end - start]
            pieces.append(piece)
            self._position += len(piece)
        return b"".join(pieces)


class StreamingUpload(PendingObject):
    """Bytes streamed to one key: a single PUT if they fit one part, else a
    multipart upload with at most ``max_concurrency`` parts in flight.

    The part being gathered is first the caller's chunks themselves (a stream
    that may still fit one PUT never takes a pool buffer, so small blobs do not
    compete with big ones for them); once the stream outgrows one part, parts
    are filled into buffers from the storage's pool. Nothing is visible at the
    key until ``publish``; ``discard`` drops it all.
    """

    def __init__(self, bucket: Bucket, key: str, part_bytes: int) -> None:
        self._bucket = bucket
        self._key = key
        self._part_bytes = part_bytes
        self._chunks: list[memoryview] | None = []  # None once the stream outgrew one part
        self._buffer: bytearray | None = None  # the pool buffer being filled
        self._filled = 0  # bytes of the current part
        self._written = 0
        self._upload_id: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._parts: list[Future] = []
        # Bounds parts in flight: write() blocks on it.
        self._slots = threading.Semaphore(bucket.max_concurrency)
        self._failure: BaseException | None = None
        self._liveness = Liveness()  # what keeps sweep_orphans off this upload

    def write(self, data: bytes | bytearray | memoryview) -> None:
        with self._bucket.active.busy(self._liveness):  # may block long on parts or buffers
            self._write(data)

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        # A bytes chunk cannot change under us, so it may be kept as it is.
        immutable = isinstance(data, bytes)
        while view:
            if self._filled == self._part_bytes:
                # Cut a part only once more bytes arrive: a stream of exactly one
                # part stays a single PUT, and the last part is never empty.
                self._send_part()
            piece = view[: self._part_bytes - self._filled]
            self._gather(piece if immutable else memoryview(piece.tobytes()))
            view = view[len(piece) :]

    def publish(self) -> None:
        """Make the bytes visible at the key (the verifier above has checked them)."""
        if self._chunks is not None:  # never outgrew one part: no multipart upload
            self._bucket.put(self._key, ViewsReader(self._chunks))
            self._chunks = []
            return
        with self._bucket.active.busy(self._liveness):  # completing may take minutes
            self._send_part()  # the last part: the only one allowed below 5 MiB
            parts = [future.result() for future in self._parts]  # re-raises a part's failure
            self._bucket.complete_multipart(self._key, self._upload_id, parts, self._written)
        self._upload_id = None  # completed: nothing left to abort
        self._shutdown_pool()

    def discard(self) -> None:
        """Discard everything: gathered bytes, parts in flight, the multipart upload. Idempotent."""
        self._chunks = []
        self._shutdown_pool()  # parts in flight give their buffers back as they end
        if self._buffer is not None:
            buffer, self._buffer = self._buffer, None
            self._bucket.buffers.release(buffer)
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            self._bucket.abort_multipart(self._key, upload_id)

    def _gather(self, piece: memoryview) -> None:
        if self._chunks is not None:
            self._chunks.append(piece)
        else:
            if self._buffer is None:  # may wait for a buffer: backpressure
                self._buffer = self._bucket.buffers.acquire(self._part_bytes)
            self._buffer[self._filled : self._filled + len(piece)] = piece
        self._filled += len(piece)
        self._written += len(piece)

    def _send_part(self) -> None:
        if self._failure is not None:  # fail fast: stop reading the client's stream
            raise self._failure
        if self._upload_id is None:
            self._upload_id = self._bucket.create_multipart(self._key, self._liveness)
            self._pool = ThreadPoolExecutor(self._bucket.max_concurrency, thread_name_prefix="cgstore-s3-part")
        part_number = len(self._parts) + 1
        if part_number > MAX_PARTS:
            raise TooLarge("blob needs more than 10000 parts; declare its size up front", parts=MAX_PARTS)
        if self._chunks is not None:
            self._chunks_into_buffer()
        self._slots.acquire()
        buffer, filled = self._buffer, self._filled
        self._buffer, self._filled = None, 0
        # A full buffer goes as it is (botocore sends a bytearray in place); only
        # the last, short part needs a reader over its filled bytes.
        body = buffer if filled == len(buffer) else ViewsReader([memoryview(buffer)[:filled]])
        future = self._pool.submit(self._upload_part, self._upload_id, part_number, body)
        future.add_done_callback(functools.partial(self._part_done, buffer))
        self._parts.append(future)

    def _upload_part(self, upload_id: str, part_number: int, body: bytearray | ViewsReader) -> dict:
        with self._bucket.active.busy(self._liveness):
            return self._bucket.upload_part(self._key, upload_id, part_number, body)

    def _chunks_into_buffer(self) -> None:
        """The stream outgrew one PUT: move its first part from the caller's chunks into a pool buffer."""
        buffer = self._bucket.buffers.acquire(self._part_bytes)
        offset = 0
        for chunk in self._chunks:
            buffer[offset : offset + len(chunk)] = chunk
            offset += len(chunk)
        self._buffer, self._chunks = buffer, None

    def _part_done(self, buffer: bytearray, future: Future) -> None:
        # Runs once upload_part returned (or the part was cancelled unsent):
        # only then may another part overwrite the buffer.
        self._bucket.buffers.release(buffer)
        self._slots.release()
        if not future.cancelled() and future.exception() is not None and self._failure is None:
            self._failure = future.exception()

    def _shutdown_pool(self) -> None:
        if self._pool is not None:
            # Waits for parts already uploading (bounded by the client timeouts),
            # so an abort that follows cannot race a straggling part.
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        # Futures hold their callbacks (bound to self): drop the cycle now, not at the next GC.
        self._parts = []
