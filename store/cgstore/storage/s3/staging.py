"""Staged uploads (resumable sessions) on S3: chunks as parts of the session's multipart upload.

Layout
------
Everything a session stages lives under ``uploads/<session>/``: one multipart
upload at ``uploads/<session>/parts`` (created by the first append that sends
a part), the empty *claim* objects ``claim-<n>`` of its part numbers, and
chunk objects ``<offset:016d>-<random>`` for what cannot be a part. The
session state (JSON in the session's row, so any process can continue it)
lists the stream in order: ``[offset, length, number, etag]`` for a part,
``[offset, length, name]`` for a chunk object, and ``upload``, the upload id.

Appends
-------
An append cuts its bytes into parts of ``part_bytes`` (pooled buffers, at most
``max_concurrency`` in flight) and uploads them as parts of the session's
upload. S3 requires every part but the last to be at least 5 MiB, and a PATCH
chunk can be any size, so what is left at the end of an append below 5 MiB
(a whole small chunk, or the remainder of a chunk that is no multiple of
``part_bytes``) becomes a chunk object, the *tail*; the next append reads the
tail back (under 5 MiB) and starts its first part with it, replacing the
tail's entry; once that append is recorded, the old tail object is deleted
(``stage_recorded``; a racer that had not read it yet lost the offset
anyway). Every part ever uploaded is therefore at least 5 MiB, and a chunk
object can only be the last entry, except after the fallback below.

Racing appends: the service records an append's state by compare-and-set of
the offset *after* the append, so two appends from one state both run. Each
part number is claimed first by creating ``claim-<n>`` with ``If-None-Match:
*``, taking the next free number after the last recorded part; two racers
can never take the same number, so the loser's parts never replace a part
the winner's state names (an ETag check alone would not do: a part replaced
by one with the same MD5 completes unnoticed). The state records each part's
size and ETag too, checked against ``ListParts`` before completing and by S3
on completion. A chunk refused mid-stream, the loser of a race and an append
killed mid-way leave parts no recorded state names. AWS would drop parts left
out of the completion, but RGW 16 refuses such a completion (``InvalidPart``,
measured), so the commit joins every uploaded part, in number order, and
reads only the recorded ranges back (the fallback below). An append that
would need a part number past 10 000 writes the rest of its bytes as a chunk
object instead.

A claim is a write to S3 (RGW 16 here: about 46 ms, for an empty object), so
an append does not wait for it between two parts: it claims the number of the
part it is filling once that part holds 5 MiB (it will be a part then, not a
tail), while the rest of it fills, one claim at a time in a thread of its own,
in stream order; the session's upload is created beside its first claim.

Commit
------
``stage_commit`` first completes the upload at ``uploads/<session>/parts``
(never at a blob key), with a last chunk object copied in as the last part
(``UploadPartCopy``, under 5 MiB). In the usual case that object is exactly
the stream: no byte was uploaded or copied again. It is verified: from the
blake3 state the appends kept when this process served every one of them
(``base.Storage.staged_verifier``), else (another process commits; the Python
binding cannot serialize a blake3 state) by reading it back and hashing it.
Only then is it made the blob: ``CopyObject`` to ``blobs/<hex>`` (over
5 GiB: ``UploadPartCopy`` ranges), skipped when an object of that size is
there already (content-addressed: whoever wrote it verified it). Then
everything under the session's prefix is dropped, the open upload included.
A dropped session is told by its claims: RGW 16 still answers ``ListParts``
and even ``CompleteMultipartUpload`` for an aborted upload.

Why not complete straight at the blob key: the digest is only named at
commit (``PUT …/uploads/{id}?digest=``), after the upload was created at a
key; and a commit without the appends' hash state would have to complete
unverified bytes at a blob key to read them back, where they would replace a
good object of the same digest (RGW 16 ignores ``If-None-Match`` on
``CompleteMultipartUpload``, measured) and be served by presigned URLs of the
blob already linked. Unverified bytes never reach a ``blobs/`` key here. The
price is one ``CopyObject``: on RGW, within one bucket, it shares the tail
RADOS objects by reference instead of copying bytes (256 MiB: 0.12 s,
against 1.39 s for the ``UploadPartCopy`` join this replaced); AWS S3 copies
inside S3.

Fallback: when the completed object is not exactly the stream (parts no
state names in between, chunk objects elsewhere than at the end: a session
staged before this layout, or past 10 000 parts), the stream is read in
order (ranges of the completed object, chunk objects) through a verifying
``writer()`` onto the blob key: one more pass, only in those cases.

``stage_abort`` aborts every multipart upload still open under the prefix
(first, so no straggling part completes), then deletes every object there.
"""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from itertools import pairwise

from botocore.exceptions import ClientError

from cgstore.core.errors import BlobUploadUnknown, DigestInvalid, RangeInvalid, SizeInvalid, Unavailable
from cgstore.storage import hashing
from cgstore.storage.hashing import check_session_id
from cgstore.storage.s3.errors import error_code, is_missing, s3_errors, stream_body
from cgstore.storage.s3.multipart import MAX_PARTS, MIN_PART_BYTES, Bucket, Liveness, StreamingUpload, ViewsReader
from cgstore.storage.writer import BlobWriter, StagedUpload, StageWriter

MAX_PART_BYTES = 5 << 30  # S3's ceiling on one part (UploadPartCopy ranges included), and on CopyObject
PARTS_NAME = "parts"  # the session's multipart upload, and the object its completion makes
# Completions S3 refuses because a listed part is not what the state recorded.
CHANGED_PART_CODES = frozenset({"InvalidPart", "InvalidPartOrder", "EntityTooSmall"})


@dataclass(frozen=True)
class Joined:
    """A completed session upload: whether it is exactly the stream, and where each entry
    (a part by number, a chunk object by name) starts in it."""

    whole: bool
    starts: dict[int | str, int]


@dataclass(frozen=True)
class Entry:
    """One recorded piece of the stream: a part (``number``, ``etag``) or a chunk object (``name``)."""

    offset: int
    length: int
    name: str | None = None
    number: int | None = None
    etag: str | None = None

    @property
    def is_part(self) -> bool:
        return self.number is not None

    def as_state(self) -> list:
        return (
            [self.offset, self.length, self.number, self.etag]
            if self.is_part
            else [self.offset, self.length, self.name]
        )


def parse_entries(staged: StagedUpload) -> list[Entry]:
    """The recorded stream in order; it must be gap-free and reach the offset (it comes back
    from the database, so every name must still be one safe key segment)."""
    entries, expected_offset = [], 0
    for raw in staged.state.get("chunks", []):
        entry = _parse_entry(raw, staged.session_id)
        if entry.offset != expected_offset or entry.length < 0:
            raise BlobUploadUnknown("staged chunks are not contiguous", session_id=staged.session_id)
        entries.append(entry)
        expected_offset += entry.length
    if expected_offset != staged.offset:
        raise BlobUploadUnknown("staged chunks do not reach the offset", session_id=staged.session_id)
    return entries


def _parse_entry(raw, session_id: str) -> Entry:
    if isinstance(raw, list) and len(raw) == 3 and all(isinstance(v, int) for v in raw[:2]):
        return Entry(raw[0], raw[1], name=check_session_id(raw[2]))
    if (
        isinstance(raw, list)
        and len(raw) == 4
        and all(isinstance(v, int) and not isinstance(v, bool) for v in raw[:3])
        and 1 <= raw[2] <= MAX_PARTS
        and isinstance(raw[3], str)
    ):
        return Entry(raw[0], raw[1], number=raw[2], etag=raw[3])
    raise BlobUploadUnknown("staged chunks are malformed", session_id=session_id)


def claim_name(number: int) -> str:
    """The object that claims part ``number`` of a session's upload."""
    return f"claim-{number:05d}"


def copy_ranges(length: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges that copy an object of ``length`` bytes as parts: equal ones of
    at most 5 GiB (S3's largest part), each at least 5 MiB when there are several."""
    count = max(1, math.ceil(length / MAX_PART_BYTES))
    bounds = [length * i // count for i in range(count + 1)]
    return list(pairwise(bounds))


class PartClaims:
    """Part numbers of one session's upload, each claimed by creating ``claim-<n>`` (see
    "Racing appends" above): increasing from ``start``, None once past ``max_parts``."""

    def __init__(self, bucket: Bucket, prefix: str, start: int, max_parts: int) -> None:
        self._bucket = bucket
        self._prefix = prefix
        self._next = start
        self._max_parts = max_parts

    def claim(self) -> int | None:
        while self._next <= self._max_parts:
            number, self._next = self._next, self._next + 1
            if self._bucket.claim(self._prefix + claim_name(number)):
                return number
        return None


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
        max_parts: int = MAX_PARTS,
    ) -> None:
        self.bucket = bucket
        self._verified_writer = writer
        self._staged_verifier = staged_verifier
        self._max_blob_bytes = max_blob_bytes
        self.max_parts = max_parts  # S3's; lower only to exercise the fallback

    def stage_begin(self, session_id: str) -> StagedUpload:
        check_session_id(session_id)
        return StagedUpload(session_id=session_id, offset=0, state={"chunks": []})

    def chunk_writer(self, staged: StagedUpload) -> StageWriter:
        """The writer of one append: parts of the session's upload (and maybe a tail object)."""
        return S3StageWriter(self, staged)

    def claims_after(self, staged: StagedUpload, entries: list[Entry]) -> PartClaims:
        """Claims of part numbers above every recorded part's."""
        last = max((entry.number for entry in entries if entry.is_part), default=0)
        return PartClaims(self.bucket, self._prefix(staged), last + 1, self.max_parts)

    def _prefix(self, staged: StagedUpload) -> str:
        return self.bucket.staging_prefix(staged.session_id)

    def _claim_key(self, staged: StagedUpload, number: int) -> str:
        return f"{self._prefix(staged)}{claim_name(number)}"

    def parts_key(self, staged: StagedUpload) -> str:
        return self._prefix(staged) + PARTS_NAME

    def stage_discard(self, before: StagedUpload, after: StagedUpload) -> None:
        """Delete the chunk objects the losing append wrote and abort the upload it created
        (its parts in a recorded upload are inert: no recorded state names their numbers)."""
        kept = {entry.name for entry in parse_entries(before) if not entry.is_part}
        added = [entry.name for entry in parse_entries(after) if not entry.is_part and entry.name not in kept]
        with s3_errors("stage_discard"):
            for name in added:  # their random names are no other append's
                self.bucket.client.delete_object(Bucket=self.bucket.name, Key=self._prefix(after) + name)
        upload_id = after.state.get("upload")
        if isinstance(upload_id, str) and upload_id != before.state.get("upload"):
            self.bucket.abort_multipart(self.parts_key(after), upload_id)

    def stage_recorded(self, before: StagedUpload, after: StagedUpload) -> None:
        """Delete the tail the recorded append carried into its first part (named by ``before``
        only): else every small chunk would leave a copy of all the small ones before it. A
        racer from ``before`` that has not read it yet lost the compare-and-set already."""
        kept = {entry.name for entry in parse_entries(after) if not entry.is_part}
        superseded = [entry.name for entry in parse_entries(before) if not entry.is_part and entry.name not in kept]
        with s3_errors("stage_recorded"):
            for name in superseded:
                self.bucket.client.delete_object(Bucket=self.bucket.name, Key=self._prefix(after) + name)

    # -- commit --------------------------------------------------------------------------
    def stage_commit(self, staged: StagedUpload, digest: str) -> int:
        # blob_key parses the digest before anything is dropped: a malformed one is a
        # bad request, not evidence that the staged bytes are wrong.
        final_key = self.bucket.blob_key(digest)
        entries = parse_entries(staged)
        try:
            joined = self._join(staged, entries) if any(entry.is_part for entry in entries) else None
            if joined is not None and joined.whole:
                self._commit_joined(staged, digest, final_key)
            else:
                self._rewrite_staged(staged, entries, digest, joined)
        except (DigestInvalid, SizeInvalid):
            self.stage_abort(staged)
            raise
        # The blob is visible; if dropping the staging fails, Unavailable lets the
        # client retry the commit (idempotent) instead of leaking the bytes.
        self.stage_abort(staged)
        return staged.offset

    def _commit_joined(self, staged: StagedUpload, digest: str, final_key: str) -> None:
        """The usual case: the completed upload is the stream. Verify it, make it the blob."""
        joined = self.parts_key(staged)
        verifier = self._staged_verifier(staged, digest)
        if verifier is None:  # another process staged some of it: read the result back
            verifier = hashing.StreamVerifier(digest, staged.offset, self._max_blob_bytes)
            for data in self._read(staged, joined, 0, staged.offset):
                verifier.update(data)
        verifier.verify()
        if not self.bucket.holds(final_key, staged.offset):
            self._copy_to(joined, final_key, staged)

    def _join(self, staged: StagedUpload, entries: list[Entry]) -> Joined:
        """Complete the session's upload at ``uploads/<session>/parts``: every part it holds
        (RGW 16 refuses a completion that leaves out an uploaded part, so the parts of lost
        races, refused chunks and killed appends are joined too and skipped when read), and
        a last chunk object copied in as the last part. Where each entry's bytes are in it."""
        key = self.parts_key(staged)
        recorded = [entry for entry in entries if entry.is_part]
        upload_id = staged.state.get("upload")
        # Dropped staging (a mismatch, a cancel) must not complete: RGW 16 keeps answering for
        # an aborted upload (ListParts and even CompleteMultipartUpload succeed, or a 500
        # "completion already in progress"), so the claim of the last part says instead.
        if (
            not isinstance(upload_id, str)
            or self.bucket.object_size(self._claim_key(staged, recorded[-1].number)) is None
        ):
            raise BlobUploadUnknown("staged upload is missing", session_id=staged.session_id)
        if self.bucket.holds(key, staged.offset):  # an earlier attempt completed the stream
            return Joined(whole=True, starts={})
        try:
            listed = self.bucket.list_parts(key, upload_id)
        except Unavailable as exc:
            if exc.detail.get("code") == "NoSuchUpload":
                raise BlobUploadUnknown("staged upload is missing", session_id=staged.session_id) from None
            raise
        for entry in recorded:  # S3 checks the ETags again on completion
            if listed.get(entry.number) != (entry.length, entry.etag):
                raise BlobUploadUnknown("staged parts changed", session_id=staged.session_id, part=entry.number)
        parts, starts, size = [], {}, 0
        for number in sorted(listed):
            parts.append({"PartNumber": number, "ETag": listed[number][1]})
            starts[number] = size
            size += listed[number][0]
        tail = entries[-1] if not entries[-1].is_part and all(e.is_part for e in entries[:-1]) else None
        if tail is not None:
            start = max(listed) + 1
            copied = self._copy_tail(staged, tail, key, upload_id, start)
            if copied is not None:
                parts += copied
                starts[tail.name] = size
                size += tail.length
        try:
            self.bucket.complete_multipart(key, upload_id, parts, size)
        except ClientError as exc:
            if error_code(exc)[0] in CHANGED_PART_CODES:  # a part is not what was listed
                raise BlobUploadUnknown("staged parts changed", session_id=staged.session_id) from None
            raise
        except Unavailable as exc:
            if exc.detail.get("code") == "NoSuchUpload":  # aborted with the session's staging
                raise BlobUploadUnknown("staged upload is missing", session_id=staged.session_id) from None
            raise
        if self.bucket.object_size(key) != size:
            # A staged object shorter than recorded (tampered with): never make it a blob.
            raise BlobUploadUnknown("staged bytes are missing", session_id=staged.session_id)
        return Joined(whole=size == staged.offset and len(starts) == len(entries), starts=starts)

    def _copy_tail(self, staged: StagedUpload, tail: Entry, key: str, upload_id: str, start: int) -> list | None:
        """Copy the last chunk object into the upload as its last part(s), under fresh claims
        from ``start``; None when no part number is left for it."""
        claims = PartClaims(self.bucket, self._prefix(staged), start, self.max_parts)
        source = self._prefix(staged) + tail.name
        parts = []
        for begin, end in copy_ranges(tail.length):
            number = claims.claim()
            if number is None:
                return None
            parts.append(self._copy_part(key, upload_id, number, source, begin, end, staged))
        return parts

    def _copy_part(
        self, key: str, upload_id: str, number: int, source: str, start: int, end: int, staged: StagedUpload
    ) -> dict:
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

    def _copy_to(self, source: str, final_key: str, staged: StagedUpload) -> None:
        """Make the verified object at ``source`` the blob: one CopyObject, or (over 5 GiB,
        CopyObject's limit) a multipart upload of copied ranges, invisible until completed."""
        if staged.offset <= MAX_PART_BYTES:
            try:
                self.bucket.copy_object(source, final_key)
            except LookupError:
                raise BlobUploadUnknown("staged bytes are missing", session_id=staged.session_id) from None
            return
        liveness = Liveness()
        upload_id = self.bucket.create_multipart(final_key, liveness)
        try:
            with self.bucket.active.busy(liveness), ThreadPoolExecutor(self.bucket.max_concurrency) as pool:
                copies = [
                    pool.submit(self._copy_part, final_key, upload_id, number, source, start, end, staged)
                    for number, (start, end) in enumerate(copy_ranges(staged.offset), start=1)
                ]
                parts = [copy.result() for copy in copies]
                self.bucket.complete_multipart(final_key, upload_id, parts, staged.offset)
        except BaseException:
            self.bucket.abort_multipart(final_key, upload_id)
            raise

    def _rewrite_staged(self, staged: StagedUpload, entries: list[Entry], digest: str, joined: Joined | None) -> None:
        """The fallback: the stream in order (ranges of the completed upload, chunk objects)
        through a verified write onto the blob key."""
        with self._verified_writer(digest, staged.offset) as writer:
            for entry in entries:
                start = None if joined is None else joined.starts.get(entry.number if entry.is_part else entry.name)
                if start is not None:
                    chunks = self._read(staged, self.parts_key(staged), start, start + entry.length)
                elif entry.is_part:  # an earlier attempt completed the upload without this layout
                    raise BlobUploadUnknown("staged upload is missing", session_id=staged.session_id)
                else:
                    chunks = self._read(staged, self._prefix(staged) + entry.name, 0, entry.length, whole=True)
                for data in chunks:
                    writer.write(data)
            writer.commit()

    def _read(self, staged: StagedUpload, key: str, start: int, end: int, *, whole: bool = False) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of a staged object (``whole``: the object must be that long)."""
        if end == start:
            return iter(())
        with s3_errors("stage_commit"):
            try:
                response = self.bucket.client.get_object(
                    Bucket=self.bucket.name, Key=key, Range=f"bytes={start}-{end - 1}"
                )
            except ClientError as exc:
                if is_missing(exc) or error_code(exc)[0] == "InvalidRange":
                    raise BlobUploadUnknown("staged bytes are missing", session_id=staged.session_id) from None
                raise
        total = int(response.get("ContentRange", "/-1").rsplit("/", 1)[-1])
        if response["ContentLength"] != end - start or (whole and total != end):
            response["Body"].close()
            raise BlobUploadUnknown("staged chunk changed size", session_id=staged.session_id, key=key)
        return stream_body(response["Body"])

    def read_tail(self, staged: StagedUpload, entry: Entry) -> bytes:
        """A tail chunk object (under 5 MiB), which the next append carries into its first part.
        Gone means another append from this state was recorded (``stage_recorded``) or the
        session was dropped: either way this append cannot be recorded."""
        try:
            return b"".join(self._read(staged, self._prefix(staged) + entry.name, 0, entry.length, whole=True))
        except BlobUploadUnknown:
            raise RangeInvalid("another chunk was committed at this offset", offset=staged.offset) from None

    # -- reclaiming --------------------------------------------------------------------------
    def stage_abort(self, staged: StagedUpload) -> None:
        prefix = self.bucket.staging_prefix(staged.session_id)
        # Open multipart uploads first: once aborted, no straggling part can
        # complete an object after the deletion below.
        self.bucket.abort_multipart_uploads(prefix)
        self._delete_prefix(prefix)

    def staged_sessions(self, written_before: datetime) -> list[str]:
        """Judged by the newest object of each session (``LastModified``). Every part is
        claimed by an object before it is sent, so a session whose upload has parts is
        listed; its open uploads go with its objects (``stage_abort``)."""
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


class S3StageWriter(StageWriter):
    """One append: parts of the session's upload, and a tail chunk object for what is left
    below 5 MiB (see "Appends" above). A tail recorded last is read back and carried into
    this append's first part, so the returned state starts this append at the tail's offset."""

    def __init__(self, uploads: StagedUploads, staged: StagedUpload) -> None:
        entries = parse_entries(staged)
        carried = entries[-1] if entries and not entries[-1].is_part and entries[-1].length < MIN_PART_BYTES else None
        self._uploads = uploads
        self._staged = staged
        self._kept = entries[:-1] if carried else entries
        self._carried = carried
        self._start = carried.offset if carried else staged.offset
        recorded = staged.state.get("upload")
        self._parts = AppendParts(
            uploads.bucket,
            uploads.parts_key(staged),
            recorded if isinstance(recorded, str) else None,
            uploads.claims_after(staged, entries),
            lambda: uploads.bucket.staging_prefix(staged.session_id) + f"{self._start:016d}-{uuid.uuid4().hex[:16]}",
        )
        self._written = 0
        self._state = "open"

    def write(self, chunk: bytes) -> None:
        if self._state != "open":
            raise RuntimeError(f"write on a {self._state} stage writer")
        try:
            if self._carried is not None and self._written == 0 and chunk:
                self._parts.write(self._uploads.read_tail(self._staged, self._carried))
            self._parts.write(chunk)
            self._written += len(chunk)
        except BaseException:
            self.abort()
            raise

    def finish(self) -> StagedUpload:
        if self._state != "open":
            raise RuntimeError(f"finish on a {self._state} stage writer")
        staged = self._staged
        if self._written == 0:  # nothing to stage: the state stays as it was
            self.abort()
            return StagedUpload(staged.session_id, staged.offset, dict(staged.state))
        try:
            added = self._parts.finish(self._start)
        except BaseException:
            self.abort()
            raise
        self._state = "finished"
        state = {**staged.state, "chunks": [entry.as_state() for entry in (*self._kept, *added)]}
        if self._parts.upload_id is not None:
            state["upload"] = self._parts.upload_id
        return StagedUpload(staged.session_id, staged.offset + self._written, state)

    def abort(self) -> None:
        if self._state == "open":
            self._state = "aborted"
            self._parts.discard()


class AppendParts:
    """The bytes of one append as parts of the session's upload (created on the first part
    if the session has none yet), cut at ``part_bytes`` in pooled buffers, at most
    ``max_concurrency`` in flight. ``finish`` sends what is left as a last part if it is at
    least 5 MiB, else writes it as a chunk object; past the last part number, the rest of
    the append goes to a chunk object (``spill``) instead.

    Each part's number is claimed while its buffer fills (``_claim_ahead``, see "Racing
    appends" above): a cut then finds it claimed instead of waiting a round trip to S3.
    ``_release`` waits for a claim still under way, so none lands after the append."""

    def __init__(
        self,
        bucket: Bucket,
        key: str,
        upload_id: str | None,
        claims: PartClaims,
        object_key: Callable[[], str],
    ) -> None:
        self._bucket = bucket
        self._key = key
        self.upload_id = upload_id
        self._created: str | None = None  # the upload this append created, if any: its to abort
        self._claims = claims
        self._object_key = object_key
        self._buffer: bytearray | None = None
        self._filled = 0
        self._sent: list[tuple[Future, int, int]] = []  # (upload_part, length, number) in stream order
        self._pool: ThreadPoolExecutor | None = None
        # Claims run one at a time in their own thread: the part pool's may all be uploading.
        self._claimer: ThreadPoolExecutor | None = None
        self._claiming: Future | None = None  # the number of the part being filled
        self._slots = threading.Semaphore(bucket.max_concurrency)
        self._failure: BaseException | None = None
        self._spill: StreamingUpload | None = None
        self._spill_key: str | None = None
        self._spilled = 0
        self._tail_key: str | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            if self._spill is not None:
                self._spill.write(view if isinstance(data, bytes) else view.tobytes())
                self._spilled += len(view)
                return
            if self._filled == self._bucket.part_bytes:
                # Cut only once more bytes arrive: the last part is never empty.
                self._cut()
                continue
            if self._buffer is None:  # may wait for a buffer: backpressure
                self._buffer = self._bucket.buffers.acquire(self._bucket.part_bytes)
            piece = view[: self._bucket.part_bytes - self._filled]
            self._buffer[self._filled : self._filled + len(piece)] = piece
            self._filled += len(piece)
            view = view[len(piece) :]
            if self._filled >= MIN_PART_BYTES and self._claiming is None:
                self._claim_ahead()  # these bytes will be a part, not a tail

    def _claim_ahead(self) -> None:
        """Start claiming the number of the part now being filled (and, for the session's
        first part, creating its upload): the previous part has taken its number already."""
        if self._spill is not None:  # no number is left
            return
        if self._claimer is None:
            self._claimer = ThreadPoolExecutor(1, thread_name_prefix="cgstore-s3-claim")
        self._claiming = self._claimer.submit(self._claim)

    def _claim(self) -> int | None:
        number = self._claims.claim()
        if number is not None and self.upload_id is None:
            self.upload_id = self._created = self._bucket.create_multipart(self._key, None)
        return number

    def _claimed(self) -> int | None:
        """The number claimed ahead for the part being cut (None: no number is left)."""
        claiming, self._claiming = self._claiming, None
        return self._claim() if claiming is None else claiming.result()

    def _cut(self) -> None:
        """Send the gathered bytes as the next part, or start the spill when no number is left."""
        if self._failure is not None:  # fail fast: stop reading the client's stream
            raise self._failure
        number = self._claimed()
        buffer, filled = self._buffer, self._filled
        self._buffer, self._filled = None, 0
        if number is None:
            self._spill_key = self._object_key()
            self._spill = StreamingUpload(self._bucket, self._spill_key, self._bucket.part_bytes)
            try:
                self._spill.write(bytes(memoryview(buffer)[:filled]))
            finally:
                self._bucket.buffers.release(buffer)
            self._spilled = filled
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._bucket.max_concurrency, thread_name_prefix="cgstore-s3-stage")
        self._slots.acquire()
        body = buffer if filled == len(buffer) else ViewsReader([memoryview(buffer)[:filled]])
        future = self._pool.submit(self._bucket.upload_part, self._key, self.upload_id, number, body)
        future.add_done_callback(lambda done, buffer=buffer: self._part_done(buffer, done))
        self._sent.append((future, filled, number))

    def _part_done(self, buffer: bytearray, future: Future) -> None:
        # Only once upload_part returned may another part overwrite the buffer.
        self._bucket.buffers.release(buffer)
        self._slots.release()
        if not future.cancelled() and future.exception() is not None and self._failure is None:
            self._failure = future.exception()

    def finish(self, start: int) -> list[Entry]:
        """Send or write what is left; the entries of this append's bytes from ``start``."""
        tail: Entry | None = None
        if self._spill is None and self._filled >= MIN_PART_BYTES:
            self._cut()  # the last part (or, past the last number, the start of a spill)
        if self._spill is not None:
            self._spill.publish()
        elif self._filled:  # below 5 MiB: a tail object, carried into the next append
            self._tail_key = self._object_key()
            self._bucket.put(self._tail_key, ViewsReader([memoryview(self._buffer)[: self._filled]]))
        entries, offset = [], start
        for future, length, number in self._sent:
            entries.append(Entry(offset, length, number=number, etag=future.result()["ETag"]))
            offset += length
        if self._spill is not None:
            tail = Entry(offset, self._spilled, name=self._spill_key.rsplit("/", 1)[-1])
        elif self._tail_key is not None:
            tail = Entry(offset, self._filled, name=self._tail_key.rsplit("/", 1)[-1])
        self._release()
        return [*entries, *([tail] if tail else [])]

    def discard(self) -> None:
        """Drop this append: parts in flight end, the tail or spill object and an upload this
        append created go (parts sent to a recorded upload stay unnamed, hence inert)."""
        self._release()
        if self._spill is not None:
            self._spill.discard()
        if self._tail_key is not None:
            with s3_errors("delete"):
                self._bucket.client.delete_object(Bucket=self._bucket.name, Key=self._tail_key)
        if self._created is not None:
            created, self._created = self._created, None
            self._bucket.abort_multipart(self._key, created)

    def _release(self) -> None:
        if self._claimer is not None:
            # A claim left unused (the tail's, or an aborted append's) ends first: no claim
            # of this append lands after the append is over (or its staging dropped).
            self._claimer.shutdown(wait=True)
            self._claimer = None
            self._claiming = None
        if self._pool is not None:
            # Waits for parts already uploading (bounded by the client timeouts).
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._buffer is not None:
            buffer, self._buffer = self._buffer, None
            self._bucket.buffers.release(buffer)
