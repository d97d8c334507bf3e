"""Staged uploads (resumable sessions) on S3: one object per chunk, joined inside S3 on commit.

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
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from itertools import pairwise

from botocore.exceptions import ClientError

from cgstore.core.errors import BlobUploadUnknown, DigestInvalid, SizeInvalid, Unavailable
from cgstore.storage import hashing
from cgstore.storage.hashing import check_session_id
from cgstore.storage.s3.errors import error_code, is_missing, s3_errors, stream_body
from cgstore.storage.s3.multipart import MAX_PARTS, MIN_PART_BYTES, Bucket, Liveness, StreamingUpload, ViewsReader
from cgstore.storage.writer import BlobWriter, StagedUpload, StageWriter

MAX_PART_BYTES = 5 << 30  # S3's ceiling on one part (UploadPartCopy ranges included)


class StagedUploads:
    """The driver's staged-upload operations, over its bucket.

    What verifies lives above the driver (``base.Storage``): the driver hands its
    verified ``writer`` and ``staged_verifier`` in, so nothing here needs the driver.
    """

    def __init__(
        self,
        bucket: Bucket,
        *,
        writer: Callable[[str, int | None], BlobWriter],
        staged_verifier: Callable[[StagedUpload, str], hashing.StreamVerifier | None],
        max_blob_bytes: int | None,
    ) -> None:
        self.bucket = bucket
        self._verified_writer = writer
        self._staged_verifier = staged_verifier
        self._max_blob_bytes = max_blob_bytes

    def stage_begin(self, session_id: str) -> StagedUpload:
        check_session_id(session_id)
        return StagedUpload(session_id=session_id, offset=0, state={"chunks": []})

    def chunk_writer(self, staged: StagedUpload) -> StageWriter:
        """The writer of one append: one new chunk object."""
        return S3StageWriter(self.bucket, staged)

    def stage_discard(self, before: StagedUpload, after: StagedUpload) -> None:
        chunks = after.state.get("chunks", [])
        if len(chunks) <= len(before.state.get("chunks", [])):
            return
        name = chunks[-1][2]  # the one this append added; its random name is no other's
        with s3_errors("stage_discard"):
            self.bucket.client.delete_object(
                Bucket=self.bucket.name, Key=self.bucket.staging_prefix(after.session_id) + check_session_id(name)
            )

    def stage_commit(self, staged: StagedUpload, digest: str) -> int:
        # parse_digest refuses a malformed digest before anything is dropped: that
        # is a bad request, not evidence that the staged bytes are wrong.
        final_key = self.bucket.blob_key(digest)
        chunks = self._staged_chunk_keys(staged)
        pieces = copy_plan(chunks)
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
        verifier = self._staged_verifier(staged, digest)
        if verifier is None:
            verifier = hashing.StreamVerifier(digest, staged.offset, self._max_blob_bytes)
            for data in self._staged_bytes(staged, chunks):
                verifier.update(data)
        verifier.verify()

    def _rewrite_staged(self, staged: StagedUpload, chunks: list[tuple[str, int]], digest: str) -> None:
        """Stream the chunk objects in order through a verified write onto the blob key."""
        with self._verified_writer(digest, staged.offset) as writer:
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
            self.bucket.put(final_key, ViewsReader([]))
            return
        liveness = Liveness()
        upload_id = self.bucket.create_multipart(final_key, liveness)
        try:
            with self.bucket.active.busy(liveness), ThreadPoolExecutor(self.bucket.max_concurrency) as pool:
                copies = [
                    pool.submit(self._copy_part, final_key, upload_id, number, piece, staged)
                    for number, piece in enumerate(pieces, start=1)
                ]
                parts = [copy.result() for copy in copies]
                self.bucket.complete_multipart(final_key, upload_id, parts, staged.offset)
        except BaseException:
            self.bucket.abort_multipart(final_key, upload_id)
            raise
        if self.bucket.object_size(final_key) != staged.offset:
            # A staged object shorter than recorded (tampered with): never leave it visible.
            with s3_errors("delete"):
                self.bucket.client.delete_object(Bucket=self.bucket.name, Key=final_key)
            raise BlobUploadUnknown("staged bytes are missing", session_id=staged.session_id)

    def _copy_part(
        self, key: str, upload_id: str, number: int, piece: tuple[str, int, int], staged: StagedUpload
    ) -> dict:
        source, start, end = piece
        with s3_errors("upload_part_copy"):
            try:
                response = self.bucket.complete_client.upload_part_copy(
                    Bucket=self.bucket.name,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    CopySource={"Bucket": self.bucket.name, "Key": source},
                    CopySourceRange=f"bytes={start}-{end - 1}",
                )
            except ClientError as exc:
                if is_missing(exc) or error_code(exc)[0] == "InvalidRange":
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
            keys.append((self.bucket.staging_prefix(staged.session_id) + check_session_id(name), length))
            expected_offset += length
        if expected_offset != staged.offset:
            raise BlobUploadUnknown("staged chunks do not reach the offset", session_id=staged.session_id)
        return keys

    def _read_staged_chunk(self, staged: StagedUpload, key: str, length: int) -> Iterator[bytes]:
        with s3_errors("stage_commit"):
            try:
                response = self.bucket.client.get_object(Bucket=self.bucket.name, Key=key)
            except ClientError as exc:
                if is_missing(exc):
                    raise BlobUploadUnknown("staged bytes are missing", session_id=staged.session_id) from None
                raise
        if response["ContentLength"] != length:
            response["Body"].close()
            raise BlobUploadUnknown("staged chunk changed size", session_id=staged.session_id, key=key)
        return stream_body(response["Body"])

    def stage_abort(self, staged: StagedUpload) -> None:
        prefix = self.bucket.staging_prefix(staged.session_id)
        # Open multipart uploads first: once aborted, no straggling part can
        # complete a chunk object after the deletion below.
        self.bucket.abort_multipart_uploads(prefix)
        self._delete_prefix(prefix)

    def staged_sessions(self, written_before: datetime) -> list[str]:
        """Judged by the newest chunk object of each session (``LastModified``). Open
        multipart uploads of a chunk are not listed: ``stage_abort`` aborts them with
        the session's objects, and a bucket lifecycle rule reclaims any left alone."""
        staging = self.bucket.key("uploads/")
        newest: dict[str, datetime] = {}
        with s3_errors("list_objects"):
            for page in self.bucket.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket.name, Prefix=staging
            ):
                for item in page.get("Contents", []):
                    session_id = item["Key"].removeprefix(staging).split("/", 1)[0]
                    newest[session_id] = max(item["LastModified"], newest.get(session_id, item["LastModified"]))
        return [
            session_id
            for session_id, written in newest.items()
            if written < written_before and hashing.is_session_id(session_id)
        ]

    def _delete_prefix(self, prefix: str) -> None:
        with s3_errors("delete_objects"):
            paginator = self.bucket.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket.name, Prefix=prefix):
                keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                if not keys:
                    continue
                # A listing page holds at most 1000 keys, delete_objects' own limit.
                response = self.bucket.client.delete_objects(
                    Bucket=self.bucket.name, Delete={"Objects": keys, "Quiet": True}
                )
                if response.get("Errors"):
                    raise Unavailable("could not delete staged objects", errors=response["Errors"][:5])


def copy_plan(chunks: list[tuple[str, int]]) -> list[tuple[str, int, int]] | None:
    """The parts ``(key, start, end)`` that join the chunk objects server-side, or None when
    S3 cannot: a chunk below 5 MiB but the last, or more than 10 000 parts. A chunk over
    5 GiB (the largest part) is copied as several equal ranges."""
    pieces: list[tuple[str, int, int]] = []
    for index, (key, length) in enumerate(chunks):
        if length < MIN_PART_BYTES and index != len(chunks) - 1:
            return None
        count = max(1, math.ceil(length / MAX_PART_BYTES))
        bounds = [length * i // count for i in range(count + 1)]
        pieces += [(key, start, end) for start, end in pairwise(bounds)]
    return pieces if len(pieces) <= MAX_PARTS else None


class S3StageWriter(StageWriter):
    """One append: one new object under the session's staging prefix.

    A fresh name per append, never one derived from the offset alone: the
    caller records the new offset by compare-and-set *after* ``finish``, so a
    racing append at the same offset must not overwrite the winner's object.
    Unrecorded objects are dropped with the session's prefix.
    """

    def __init__(self, bucket: Bucket, staged: StagedUpload) -> None:
        self._staged = staged
        self._name = f"{staged.offset:016d}-{uuid.uuid4().hex[:16]}"
        key = bucket.staging_prefix(staged.session_id) + self._name
        self._upload = StreamingUpload(bucket, key, bucket.part_bytes)
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
