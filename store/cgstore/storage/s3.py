"""The S3 driver: any S3-compatible store (AWS S3, MinIO, Ceph, moto) via boto3.

URL: ``s3://bucket[/prefix]?endpoint_url=…&region=…``. A plain object store
(``ObjectStore`` in base.py); verifying blobs is done above it, once for every
driver (``writer.py``). Keys under the optional prefix are the same as the fs
driver's: ``blobs/<hex[:2]>/<hex>`` for blobs, ``uploads/<session_id>/…`` for
staged uploads.

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

Staged uploads (resumable sessions)
-----------------------------------
S3 parts must be ≥ 5 MiB except the last, but a PATCH chunk can be any size,
and any server process may serve the next PATCH. The design taken: every PATCH
chunk becomes its own object ``uploads/<session>/<offset:016d>-<random>``
(written with the same streaming upload, so a huge chunk is itself a multipart
upload and a small one a single PUT); the session state records ``[offset,
length, name]`` of every chunk. The random part matters: the caller records a
new offset by compare-and-set after ``stage_append`` returns, so two racing
appends at one offset must not overwrite each other's object; the loser's is
deleted (``stage_discard``), and a chunk refused mid-stream (shorter or longer
than its Content-Range) never becomes an object at all.

``stage_commit`` verifies the stream first: from the blake3 state the appends
kept when this process served them all (``base.Storage.staged_verifier``),
else by reading the recorded chunk objects back in order. Only then are the
chunks joined at the final key *inside S3*: one multipart upload whose parts
are ``UploadPartCopy`` of the chunk objects (a chunk over 5 GiB as several
ranges), completed, then everything under the session's prefix is deleted
(unrecorded chunks of lost races or crashed appends included). Chunks S3
cannot join that way (one below 5 MiB but the last, more than 10 000 parts)
are streamed through a verifying ``writer()`` onto the final key instead.

- Why: it is the simplest correct design. Every chunk object is atomic (a
  chunk that fails midway leaves no object, and its multipart upload is
  aborted), objects are never modified once written, and any chunk size
  works.
- Cost: in the usual case (one process, chunks of 5 MiB or more) a staged
  blob crosses this server once, like a monolithic PUT; S3 copies it once
  more internally. Uploading chunks as parts of the final multipart upload
  would save that copy, but the parts of an open upload cannot be read: a
  commit on another process (which lacks this one's blake3 state, and the
  Python binding cannot serialize it) could not verify them before they
  became visible. It would also need part numbers racing appends cannot both
  take (a part replaced by one with the same MD5, its ETag, would complete
  unnoticed) and a place for chunks below S3's 5 MiB floor.
- ``stage_abort`` deletes every object under ``uploads/<session>/`` and aborts
  any multipart upload still open there (a process killed mid-chunk).

Failures
--------
Connection errors, timeouts, 5xx, throttling, and credential or bucket
misconfiguration raise ``Unavailable``; a missing object raises
``BlobUnknown`` (or ``BlobUploadUnknown`` for staging). botocore is configured
with short connect timeouts and two retries, so a dead store surfaces within
seconds.

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

Orphans
-------
A multipart upload left open by a process killed mid-write is reclaimed by
``sweep_orphans`` (a bucket lifecycle rule ``AbortIncompleteMultipartUpload``
does the same and is recommended too). Other processes' uploads are judged by
the store's ``Initiated``; this process's own (``_ActiveUploads``) by how long
their writer has been idle, which is exact: an upload being written to, or
with a part or its completion under way, is never aborted, and an idle one
only once idle for ``max(older_than_s, LIVE_WRITER_GRACE_S)`` (the grace keeps
a sweep with a tiny threshold off a live request between two chunks). Why not
``Initiated`` alone: some stores misreport it (moto says 2010 for every
upload), which made each reaper tick abort every upload in flight. Why not
"never ours": a writer this process abandoned (a stuck or leaked request) must
be reclaimed too, like a dead process's.

Flexible checksums (CRC headers, botocore ≥ 1.36) are only sent when an
operation requires them: several S3-compatible stores reject them. Transfer
integrity rests on TLS; stored bytes are re-verifiable by blake3 sweeps.
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
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from urllib.parse import urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionError as BotoConnectionError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)

from cgstore.core.errors import BlobUploadUnknown, DigestInvalid, SizeInvalid, TooLarge, Unavailable
from cgstore.settings import parse_s3_url
from cgstore.storage import hashing
from cgstore.storage.base import ObjectInfo, ObjectMissing, StagedUpload, StageWriter, Storage
from cgstore.storage.hashing import READ_CHUNK_BYTES, check_session_id
from cgstore.storage.presign import BatchPresigner
from cgstore.storage.writer import PendingObject

logger = logging.getLogger(__name__)

MiB = 1 << 20
MIN_PART_BYTES = 5 * MiB  # S3's floor for every part but the last
MAX_PARTS = 10_000  # S3's ceiling on parts per multipart upload
MAX_PART_BYTES = 5 << 30  # S3's ceiling on one part (UploadPartCopy ranges included)
DELETE_BATCH_KEYS = 1000  # S3's ceiling on keys per DeleteObjects request
# Assembling a multi-GiB object can take minutes (moto: 7-11 s per GiB); a
# complete cut short by the read timeout would be retried after it succeeded.
COMPLETE_READ_TIMEOUT_S = 300.0
# How long a writer waits for a free part buffer before answering Unavailable:
# well above a part upload's worst case (retries × timeouts), so only a store
# overloaded for minutes (or stalled clients holding every buffer) hits it.
BUFFER_WAIT_S = 120.0
# A writer of this process idle for less than this is between two chunks of a
# live request: sweep_orphans spares it whatever its threshold.
LIVE_WRITER_GRACE_S = 5.0
_CONTENT_TYPE = "application/octet-stream"

# Answers that mean "the store cannot serve us right now" rather than a bug
# here: throttling, and misconfiguration an operator must fix (bucket, keys).
_UNAVAILABLE_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "NoSuchBucket",
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "NoSuchUpload",  # our multipart upload vanished (swept or expired): retry from scratch
    }
)
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_TRANSPORT_ERRORS = (
    BotoConnectionError,  # EndpointConnectionError, ConnectTimeoutError, proxy/SSL errors
    HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)


def parse_storage_url(url: str) -> tuple[str, str, str | None, str | None]:
    """``s3://bucket/some/prefix?endpoint_url=…&region=…`` → (bucket, "some/prefix/", endpoint, region)."""
    bucket, endpoint_url, region = parse_s3_url(url)
    prefix = urlparse(url).path.strip("/")
    return bucket, f"{prefix}/" if prefix else "", endpoint_url, region


def _error_code(exc: ClientError) -> tuple[str, int]:
    error = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(error.get("Code", "")), int(status or 0)


def _is_missing(exc: ClientError) -> bool:
    code, status = _error_code(exc)
    return code in _MISSING_CODES or (status == 404 and code != "NoSuchBucket")


def _is_unavailable(exc: ClientError) -> bool:
    code, status = _error_code(exc)
    return status >= 500 or status == 403 or code in _UNAVAILABLE_CODES


@contextlib.contextmanager
def _s3_errors(operation: str) -> Iterator[None]:
    """Turn infrastructure failures into ``Unavailable``; let real bugs through."""
    try:
        yield
    except ClientError as exc:
        if _is_unavailable(exc):
            code, status = _error_code(exc)
            raise Unavailable("object storage failed", operation=operation, code=code, status=status) from exc
        raise
    except _TRANSPORT_ERRORS as exc:
        # The exception's type says what failed; its text names internal endpoints (kept in the log).
        raise Unavailable("object storage unreachable", operation=operation, cause=type(exc).__name__) from exc


def _client_config(
    *, endpoint_url, max_concurrency, callers, connect_timeout_s, read_timeout_s, max_attempts
) -> Config:
    options = dict(
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        # Bounded, so a dead store surfaces within seconds instead of stalling requests.
        retries={"total_max_attempts": max_attempts, "mode": "standard"},
        # Every request thread may hold a connection, and several writes run at once, each
        # with max_concurrency part uploads: a smaller pool discards (and later reopens)
        # connections under load, warning "Connection pool is full" (seen in bench/load.py).
        max_pool_connections=max(10, callers + 4 * max_concurrency),
        signature_version="s3v4",
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    if endpoint_url:
        # S3-compatible stores (MinIO, Ceph, moto) rarely serve virtual-host names.
        options["s3"] = {"addressing_style": "path"}
    return Config(**options)


class S3Storage(Storage):
    """Objects and staged uploads in one bucket, under an optional key prefix."""

    supports_presign = True

    def __init__(
        self,
        bucket: str,
        *,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        public_endpoint_url: str | None = None,
        part_bytes: int = 16 * MiB,
        max_concurrency: int = 4,
        callers: int = 0,  # threads that may call S3 at once (the request threads): sizes the pool
        max_blob_bytes: int | None = None,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 10.0,
        max_attempts: int = 3,
        complete_read_timeout_s: float = COMPLETE_READ_TIMEOUT_S,
    ) -> None:
        if part_bytes < MIN_PART_BYTES:
            raise ValueError(f"part_bytes must be at least {MIN_PART_BYTES} (S3's minimum part size)")
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.part_bytes = part_bytes
        self.max_concurrency = max_concurrency
        self.max_blob_bytes = max_blob_bytes
        config = _client_config(
            endpoint_url=endpoint_url,
            max_concurrency=max_concurrency,
            callers=callers,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            max_attempts=max_attempts,
        )
        # A session per storage: boto3's default session is not thread-safe to build clients from.
        session = boto3.session.Session()
        self.client = session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)
        # Only CompleteMultipartUpload and UploadPartCopy may take minutes (see the module docstring).
        self._complete_client = session.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            config=config.merge(Config(read_timeout=complete_read_timeout_s)),
        )
        self._buffers = _PartBuffers(limit=max(8, 2 * max_concurrency), wait_s=BUFFER_WAIT_S)
        self._active = _ActiveUploads()
        # Presigned URLs name the host clients reach, which may differ from ours.
        if public_endpoint_url and public_endpoint_url != endpoint_url:
            public_config = _client_config(
                endpoint_url=public_endpoint_url,
                max_concurrency=1,
                callers=0,
                connect_timeout_s=connect_timeout_s,
                read_timeout_s=read_timeout_s,
                max_attempts=max_attempts,
            )
            self.presign_client = session.client(
                "s3", endpoint_url=public_endpoint_url, region_name=region, config=public_config
            )
        else:
            self.presign_client = self.client
        self._credentials = session.get_credentials()
        self._presigner = BatchPresigner(self.presign_client, self._credentials, self.bucket)

    @classmethod
    def from_settings(cls, settings) -> S3Storage:
        bucket, prefix, endpoint_url, region = parse_storage_url(settings.resolved_storage_url)
        return cls(
            bucket,
            prefix=prefix,
            endpoint_url=endpoint_url,
            region=region,
            public_endpoint_url=settings.s3_public_endpoint_url,
            part_bytes=settings.s3_part_bytes,
            max_concurrency=settings.s3_max_concurrency,
            callers=settings.worker_threads,
            max_blob_bytes=settings.max_blob_bytes,
        )

    # -- keys ------------------------------------------------------------------------
    def key(self, relative: str) -> str:
        """The object key of ``relative`` (``blobs/…``, ``uploads/…``) under the prefix."""
        return self.prefix + relative

    def blob_key(self, digest: str) -> str:
        """The object key of the blob ``digest``."""
        return self.key(hashing.blob_key(hashing.parse_digest(digest)))

    def _staging_prefix(self, session_id: str) -> str:
        return self.key(f"uploads/{check_session_id(session_id)}/")

    def _part_bytes_for(self, size: int | None) -> int:
        """The configured part size, grown (whole MiB) when a known size needs > 10 000 parts."""
        if size is None:
            return self.part_bytes
        needed = math.ceil(math.ceil(size / MAX_PARTS) / MiB) * MiB
        return max(self.part_bytes, needed)

    # -- object primitives ---------------------------------------------------------------
    def open_write(self, key: str, size_hint: int | None = None) -> PendingObject:
        return _StreamingUpload(self, self.key(key), self._part_bytes_for(size_hint))

    def stat(self, key: str) -> int | None:
        return self._object_size(self.key(key))

    def read_range(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        if end is not None and end == start:  # S3 has no empty Range; still answer "absent"
            if self.stat(key) is None:
                raise ObjectMissing(key)
            return iter(())
        request = {"Bucket": self.bucket, "Key": self.key(key)}
        if start > 0 or end is not None:
            request["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        # The GET is issued now, not on first iteration: an absent object must
        # raise before the caller commits to a response.
        with _s3_errors("read"):
            try:
                response = self.client.get_object(**request)
            except ClientError as exc:
                if _is_missing(exc):
                    raise ObjectMissing(key) from None
                if _error_code(exc)[0] == "InvalidRange":  # start at or past the end
                    return iter(())
                raise
        return _stream_body(response["Body"])

    def list_keys(self, prefix: str, cursor: str | None = None, limit: int = 1000) -> tuple[list[ObjectInfo], str | None]:
        """Keys in S3's own (UTF-8 byte) order; the cursor is the last key, passed as ``StartAfter``."""
        request = {"Bucket": self.bucket, "Prefix": self.key(prefix), "MaxKeys": min(limit, 1000)}
        if cursor:
            request["StartAfter"] = self.key(cursor)
        with _s3_errors("list_objects"):
            response = self.client.list_objects_v2(**request)
        found = [
            ObjectInfo(item["Key"].removeprefix(self.prefix), item["Size"]) for item in response.get("Contents", [])
        ]
        return found, (found[-1].key if found and response.get("IsTruncated") else None)

    def presign_key(self, key: str, ttl_s: int) -> str | None:
        with _s3_errors("presign"):  # signing is local; only missing credentials can fail
            return self.presign_client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": self.key(key)}, ExpiresIn=ttl_s
            )

    def presigned_urls(self, digests: list[str], ttl_s: int) -> dict[str, str]:
        unique = list(dict.fromkeys(digests))
        with _s3_errors("presign"):
            urls = self._presigner.urls([self.blob_key(d) for d in unique], ttl_s)
        return dict(zip(unique, urls))

    def delete_key(self, key: str) -> None:
        with _s3_errors("delete"):
            self.client.delete_object(Bucket=self.bucket, Key=self.key(key))

    def delete_many(self, digests: list[str]) -> None:
        # One request per 1000 keys (delete_objects' limit); S3 reports no error
        # for a key that is already gone, which is what a retried batch needs.
        for start in range(0, len(digests), DELETE_BATCH_KEYS):
            keys = [{"Key": self.blob_key(d)} for d in digests[start : start + DELETE_BATCH_KEYS]]
            with _s3_errors("delete_objects"):
                response = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
            if response.get("Errors"):
                raise Unavailable("could not delete blobs", errors=response["Errors"][:5])

    # -- staged uploads -------------------------------------------------------------------
    def stage_begin(self, session_id: str) -> StagedUpload:
        check_session_id(session_id)
        return StagedUpload(session_id=session_id, offset=0, state={"chunks": []})

    def _stage_writer(self, staged: StagedUpload) -> StageWriter:
        return S3StageWriter(self, staged)

    def stage_discard(self, before: StagedUpload, after: StagedUpload) -> None:
        chunks = after.state.get("chunks", [])
        if len(chunks) <= len(before.state.get("chunks", [])):
            return
        name = chunks[-1][2]  # the one this append added; its random name is no other's
        with _s3_errors("stage_discard"):
            self.client.delete_object(
                Bucket=self.bucket, Key=self._staging_prefix(after.session_id) + check_session_id(name)
            )

    def stage_commit(self, staged: StagedUpload, digest: str) -> int:
        # parse_digest refuses a malformed digest before anything is dropped: that
        # is a bad request, not evidence that the staged bytes are wrong.
        final_key = self.key(hashing.blob_key(hashing.parse_digest(digest)))
        chunks = self._staged_chunk_keys(staged)
        pieces = _copy_plan(chunks)
        try:
            if pieces is None:  # chunks S3 cannot join server-side: stream them through
                self._rewrite_staged(staged, chunks, digest)
            else:
                self._verify_staged(staged, chunks, digest)
                self._assemble(final_key, pieces, staged)
        except (DigestInvalid, SizeInvalid):
            self.stage_abort(staged)
            raise
        # The blob is visible; if dropping the staging fails, Unavailable lets the
        # client retry the commit (idempotent) instead of leaking the bytes.
        self.stage_abort(staged)
        return staged.offset

    def _verify_staged(self, staged: StagedUpload, chunks: list[tuple[str, int]], digest: str) -> None:
        """Verify the staged stream: from the appends' hash, else by reading it back."""
        verifier = self.staged_verifier(staged, digest)
        if verifier is None:
            verifier = hashing.StreamVerifier(digest, staged.offset, self.max_blob_bytes)
            for data in self._staged_bytes(staged, chunks):
                verifier.update(data)
        verifier.verify()

    def _rewrite_staged(self, staged: StagedUpload, chunks: list[tuple[str, int]], digest: str) -> None:
        """Stream the chunk objects in order through a verified write onto the blob key."""
        with self.writer(digest, staged.offset) as writer:
            for data in self._staged_bytes(staged, chunks):
                writer.write(data)
            writer.commit()

    def _staged_bytes(self, staged: StagedUpload, chunks: list[tuple[str, int]]) -> Iterator[bytes]:
        for key, length in chunks:
            yield from self._read_staged_chunk(staged, key, length)

    def _assemble(self, final_key: str, pieces: list[tuple[str, int, int]], staged: StagedUpload) -> None:
        """Join the verified chunk objects at ``final_key`` inside S3 (UploadPartCopy): no byte
        crosses this server again. Invisible until the completion, aborted on any failure."""
        if not pieces:  # an empty blob
            self._put(final_key, _ViewsReader([]))
            return
        liveness = _Liveness()
        upload_id = self._create_multipart(final_key, liveness)
        try:
            with self._active.busy(liveness), ThreadPoolExecutor(self.max_concurrency) as pool:
                copies = [
                    pool.submit(self._copy_part, final_key, upload_id, number, piece, staged)
                    for number, piece in enumerate(pieces, start=1)
                ]
                parts = [copy.result() for copy in copies]
                self._complete_multipart(final_key, upload_id, parts, staged.offset)
        except BaseException:
            self._abort_multipart(final_key, upload_id)
            raise
        if self._object_size(final_key) != staged.offset:
            # A staged object shorter than recorded (tampered with): never leave it visible.
            self.delete_key(final_key.removeprefix(self.prefix))
            raise BlobUploadUnknown("staged bytes are missing", session_id=staged.session_id)

    def _copy_part(self, key: str, upload_id: str, number: int, piece: tuple[str, int, int], staged: StagedUpload) -> dict:
        source, start, end = piece
        with _s3_errors("upload_part_copy"):
            try:
                response = self._complete_client.upload_part_copy(
                    Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number,
                    CopySource={"Bucket": self.bucket, "Key": source}, CopySourceRange=f"bytes={start}-{end - 1}",
                )
            except ClientError as exc:
                if _is_missing(exc) or _error_code(exc)[0] == "InvalidRange":
                    raise BlobUploadUnknown("staged bytes are missing", session_id=staged.session_id) from None
                raise
        return {"PartNumber": number, "ETag": response["CopyPartResult"]["ETag"]}

    def _staged_chunk_keys(self, staged: StagedUpload) -> list[tuple[str, int]]:
        """The chunk objects in stream order; the state must describe a gap-free stream."""
        keys, expected_offset = [], 0
        for offset, length, name in staged.state.get("chunks", []):
            if offset != expected_offset:
                raise BlobUploadUnknown("staged chunks are not contiguous", session_id=staged.session_id)
            # The name comes back from the database: it must still be one safe key segment.
            keys.append((self._staging_prefix(staged.session_id) + check_session_id(name), length))
            expected_offset += length
        if expected_offset != staged.offset:
            raise BlobUploadUnknown("staged chunks do not reach the offset", session_id=staged.session_id)
        return keys

    def _read_staged_chunk(self, staged: StagedUpload, key: str, length: int) -> Iterator[bytes]:
        with _s3_errors("stage_commit"):
            try:
                response = self.client.get_object(Bucket=self.bucket, Key=key)
            except ClientError as exc:
                if _is_missing(exc):
                    raise BlobUploadUnknown("staged bytes are missing", session_id=staged.session_id) from None
                raise
        if response["ContentLength"] != length:
            response["Body"].close()
            raise BlobUploadUnknown("staged chunk changed size", session_id=staged.session_id, key=key)
        return _stream_body(response["Body"])

    def stage_abort(self, staged: StagedUpload) -> None:
        prefix = self._staging_prefix(staged.session_id)
        # Open multipart uploads first: once aborted, no straggling part can
        # complete a chunk object after the deletion below.
        self._abort_multipart_uploads(prefix)
        self._delete_prefix(prefix)

    def staged_sessions(self, written_before: datetime) -> list[str]:
        """Judged by the newest chunk object of each session (``LastModified``). Open
        multipart uploads of a chunk are not listed: ``stage_abort`` aborts them with
        the session's objects, and a bucket lifecycle rule reclaims any left alone."""
        staging = self.key("uploads/")
        newest: dict[str, datetime] = {}
        with _s3_errors("list_objects"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=staging):
                for item in page.get("Contents", []):
                    session_id = item["Key"].removeprefix(staging).split("/", 1)[0]
                    newest[session_id] = max(item["LastModified"], newest.get(session_id, item["LastModified"]))
        return [
            session_id
            for session_id, written in newest.items()
            if written < written_before and hashing.is_session_id(session_id)
        ]

    # -- operations ------------------------------------------------------------------------
    def ping(self) -> None:
        with _s3_errors("ping"):
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except ClientError as exc:  # a missing bucket is an outage to the service, too
                code, status = _error_code(exc)
                raise Unavailable("bucket not reachable", bucket=self.bucket, code=code, status=status) from exc

    def sweep_orphans(self, older_than_s: float) -> int:
        """Abort blob multipart uploads (processes killed mid-write) older than ``older_than_s``.

        This process's own uploads count as old only once their writer has been
        idle that long (at least ``LIVE_WRITER_GRACE_S``), whatever ``Initiated``
        says (moto reports 2010 for all of them).
        """
        cutoff = datetime.now(UTC) - timedelta(seconds=older_than_s)
        idle_s = max(older_than_s, LIVE_WRITER_GRACE_S)
        return self._abort_multipart_uploads(self.key("blobs/"), initiated_before=cutoff, spare_idle_s=idle_s)

    # -- plumbing used by _StreamingUpload and the staging ---------------------------------
    def _object_size(self, key: str) -> int | None:
        with _s3_errors("size"):
            try:
                return self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
            except ClientError as exc:
                if _is_missing(exc):
                    return None
                raise

    def _put(self, key: str, body: bytearray | _ViewsReader) -> None:
        with _s3_errors("put_object"):
            self.client.put_object(Bucket=self.bucket, Key=key, Body=body, ContentType=_CONTENT_TYPE)

    def _create_multipart(self, key: str, liveness: _Liveness) -> str:
        with self._active.creating(key), _s3_errors("create_multipart_upload"):
            response = self.client.create_multipart_upload(Bucket=self.bucket, Key=key, ContentType=_CONTENT_TYPE)
            upload_id = response["UploadId"]
            # Before leaving creating(): no moment a sweep could take it for an orphan.
            self._active.add(upload_id, liveness)
        return upload_id

    def _upload_part(self, key: str, upload_id: str, part_number: int, body: bytearray | _ViewsReader) -> dict:
        with _s3_errors("upload_part"):
            response = self.client.upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=part_number, Body=body
            )
        return {"PartNumber": part_number, "ETag": response["ETag"]}

    def _complete_multipart(self, key: str, upload_id: str, parts: list[dict], size: int) -> None:
        """Complete, idempotently: an object of the verified ``size`` already at ``key`` is success."""
        try:
            with _s3_errors("complete_multipart_upload"):
                self._complete_client.complete_multipart_upload(
                    Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                )
        except Unavailable:
            # NoSuchUpload, a 5xx or a timeout after the retries: an earlier attempt
            # may have completed it, its answer lost. Our keys are ours alone
            # (content-addressed or random), so an object of our size is our bytes.
            if not self._holds(key, size):
                raise
            logger.info("completing %s failed, but an earlier attempt had completed it (%d bytes)", key, size)
        self._active.discard(upload_id)

    def _holds(self, key: str, size: int) -> bool:
        try:
            return self._object_size(key) == size
        except Unavailable:  # the complete's own error is the one to report
            return False

    def _abort_multipart(self, key: str, upload_id: str) -> None:
        """Abort on an error path: never raise over the original error, but say what leaked."""
        try:
            with _s3_errors("abort_multipart_upload"):
                try:
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
                except ClientError as exc:
                    if _error_code(exc)[0] != "NoSuchUpload":  # already gone is what we wanted
                        raise
        except (ClientError, Unavailable) as exc:
            logger.warning(
                "abort of multipart upload %s on %s failed (sweep_orphans or stage_abort reclaims it): %s", upload_id, key, exc
            )
        finally:
            self._active.discard(upload_id)

    def _abort_multipart_uploads(
        self, prefix: str, initiated_before: datetime | None = None, spare_idle_s: float | None = None
    ) -> int:
        """Abort the open multipart uploads under ``prefix``; return how many. Optionally
        only those initiated before ``initiated_before``, and sparing this process's own
        unless idle for ``spare_idle_s``."""
        aborted = 0
        with _s3_errors("list_multipart_uploads"):
            paginator = self.client.get_paginator("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                for upload in page.get("Uploads", []):
                    if initiated_before is not None and upload["Initiated"] >= initiated_before:
                        continue
                    if spare_idle_s is not None and self._active.live(upload["Key"], upload["UploadId"], spare_idle_s):
                        continue
                    try:
                        self.client.abort_multipart_upload(
                            Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                    except ClientError as exc:
                        if _error_code(exc)[0] != "NoSuchUpload":  # raced with its own abort
                            raise
                    aborted += 1
        return aborted

    def _delete_prefix(self, prefix: str) -> None:
        with _s3_errors("delete_objects"):
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                if not keys:
                    continue
                # A listing page holds at most 1000 keys, delete_objects' own limit.
                response = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
                if response.get("Errors"):
                    raise Unavailable("could not delete staged objects", errors=response["Errors"][:5])


def _copy_plan(chunks: list[tuple[str, int]]) -> list[tuple[str, int, int]] | None:
    """The parts ``(key, start, end)`` that join the chunk objects server-side, or None when
    S3 cannot: a chunk below 5 MiB but the last, or more than 10 000 parts. A chunk over
    5 GiB (the largest part) is copied as several equal ranges."""
    pieces: list[tuple[str, int, int]] = []
    for index, (key, length) in enumerate(chunks):
        if length < MIN_PART_BYTES and index != len(chunks) - 1:
            return None
        count = max(1, math.ceil(length / MAX_PART_BYTES))
        bounds = [length * i // count for i in range(count + 1)]
        pieces += [(key, start, end) for start, end in zip(bounds, bounds[1:])]
    return pieces if len(pieces) <= MAX_PARTS else None


def _stream_body(body) -> Iterator[bytes]:
    """Yield an object's body in bounded chunks; mid-stream failures are outages."""
    try:
        with _s3_errors("read"):
            yield from body.iter_chunks(READ_CHUNK_BYTES)
    finally:
        body.close()


@dataclasses.dataclass
class _Liveness:
    """How busy one streaming upload is, and since when it is idle (guarded by
    ``_ActiveUploads``' lock)."""

    busy: int = 0  # writes, part uploads and completions under way
    since: float = dataclasses.field(default_factory=time.monotonic)  # when last busy


class _ActiveUploads:
    """This process's open multipart uploads and how long each has been idle: what
    ``sweep_orphans`` must not take for an orphan (see "Orphans" above).

    A key is registered *before* CreateMultipartUpload is sent and its upload id
    before the key is let go, so a sweep listing in between still sees the
    upload as ours. Thread-safe: writers, part uploads and the reaper run in
    different threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._uploads: dict[str, _Liveness] = {}
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

    def add(self, upload_id: str, liveness: _Liveness) -> None:
        with self._lock:
            liveness.since = time.monotonic()
            self._uploads[upload_id] = liveness

    def discard(self, upload_id: str) -> None:
        with self._lock:
            self._uploads.pop(upload_id, None)

    @contextlib.contextmanager
    def busy(self, liveness: _Liveness) -> Iterator[None]:
        """Mark an upload as worked on meanwhile (its id may not even exist yet)."""
        self._step(liveness, +1)
        try:
            yield
        finally:
            self._step(liveness, -1)

    def _step(self, liveness: _Liveness, step: int) -> None:
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


class _PartBuffers:
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


class _ViewsReader:
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


class _StreamingUpload(PendingObject):
    """Bytes streamed to one key: a single PUT if they fit one part, else a
    multipart upload with at most ``max_concurrency`` parts in flight.

    The part being gathered is first the caller's chunks themselves (a stream
    that may still fit one PUT never takes a pool buffer, so small blobs do not
    compete with big ones for them); once the stream outgrows one part, parts
    are filled into buffers from the storage's pool. Nothing is visible at the
    key until ``publish``; ``discard`` drops it all.
    """

    def __init__(self, storage: S3Storage, key: str, part_bytes: int) -> None:
        self._storage = storage
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
        self._slots = threading.Semaphore(storage.max_concurrency)
        self._failure: BaseException | None = None
        self._liveness = _Liveness()  # what keeps sweep_orphans off this upload

    def write(self, data: bytes | bytearray | memoryview) -> None:
        with self._storage._active.busy(self._liveness):  # may block long on parts or buffers
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
            self._storage._put(self._key, _ViewsReader(self._chunks))
            self._chunks = []
            return
        with self._storage._active.busy(self._liveness):  # completing may take minutes
            self._send_part()  # the last part: the only one allowed below 5 MiB
            parts = [future.result() for future in self._parts]  # re-raises a part's failure
            self._storage._complete_multipart(self._key, self._upload_id, parts, self._written)
        self._upload_id = None  # completed: nothing left to abort
        self._shutdown_pool()

    def discard(self) -> None:
        """Discard everything: gathered bytes, parts in flight, the multipart upload. Idempotent."""
        self._chunks = []
        self._shutdown_pool()  # parts in flight give their buffers back as they end
        if self._buffer is not None:
            buffer, self._buffer = self._buffer, None
            self._storage._buffers.release(buffer)
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            self._storage._abort_multipart(self._key, upload_id)

    def _gather(self, piece: memoryview) -> None:
        if self._chunks is not None:
            self._chunks.append(piece)
        else:
            if self._buffer is None:  # may wait for a buffer: backpressure
                self._buffer = self._storage._buffers.acquire(self._part_bytes)
            self._buffer[self._filled : self._filled + len(piece)] = piece
        self._filled += len(piece)
        self._written += len(piece)

    def _send_part(self) -> None:
        if self._failure is not None:  # fail fast: stop reading the client's stream
            raise self._failure
        if self._upload_id is None:
            self._upload_id = self._storage._create_multipart(self._key, self._liveness)
            self._pool = ThreadPoolExecutor(self._storage.max_concurrency, thread_name_prefix="cgstore-s3-part")
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
        body = buffer if filled == len(buffer) else _ViewsReader([memoryview(buffer)[:filled]])
        future = self._pool.submit(self._upload_part, self._upload_id, part_number, body)
        future.add_done_callback(functools.partial(self._part_done, buffer))
        self._parts.append(future)

    def _upload_part(self, upload_id: str, part_number: int, body: bytearray | _ViewsReader) -> dict:
        with self._storage._active.busy(self._liveness):
            return self._storage._upload_part(self._key, upload_id, part_number, body)

    def _chunks_into_buffer(self) -> None:
        """The stream outgrew one PUT: move its first part from the caller's chunks into a pool buffer."""
        buffer = self._storage._buffers.acquire(self._part_bytes)
        offset = 0
        for chunk in self._chunks:
            buffer[offset : offset + len(chunk)] = chunk
            offset += len(chunk)
        self._buffer, self._chunks = buffer, None

    def _part_done(self, buffer: bytearray, future: Future) -> None:
        # Runs once upload_part returned (or the part was cancelled unsent):
        # only then may another part overwrite the buffer.
        self._storage._buffers.release(buffer)
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


class S3StageWriter(StageWriter):
    """One append: one new object under the session's staging prefix.

    A fresh name per append, never one derived from the offset alone: the
    caller records the new offset by compare-and-set *after* ``finish``, so a
    racing append at the same offset must not overwrite the winner's object.
    Unrecorded objects are dropped with the session's prefix.
    """

    def __init__(self, storage: S3Storage, staged: StagedUpload) -> None:
        self._storage = storage
        self._staged = staged
        self._name = f"{staged.offset:016d}-{uuid.uuid4().hex[:16]}"
        key = storage._staging_prefix(staged.session_id) + self._name
        self._upload = _StreamingUpload(storage, key, storage.part_bytes)
        self._written = 0
        self._state = "open"

    def write(self, chunk: bytes) -> None:
        if self._state != "open":
            raise RuntimeError(f"write on a {self._state} stage writer")
        try:
            self._upload.write(chunk)
            self._written += len(chunk)
        except BaseException:
            self.abort()
            raise

    def finish(self) -> StagedUpload:
        if self._state != "open":
            raise RuntimeError(f"finish on a {self._state} stage writer")
        staged = self._staged
        if self._written == 0:  # nothing to stage; an empty object would only be clutter
            self.abort()
            return StagedUpload(staged.session_id, staged.offset, dict(staged.state))
        try:
            self._upload.publish()
        except BaseException:
            self.abort()
            raise
        self._state = "finished"
        chunk_list = [*staged.state.get("chunks", []), [staged.offset, self._written, self._name]]
        return StagedUpload(staged.session_id, staged.offset + self._written, {**staged.state, "chunks": chunk_list})

    def abort(self) -> None:
        if self._state == "open":
            self._state = "aborted"
            self._upload.discard()
