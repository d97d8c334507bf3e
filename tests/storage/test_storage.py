"""The storage contract (storage/base.py), checked on both backends against real servers.

Every test taking ``storage_case`` runs twice: ``fs`` (a directory in tmp_path)
and ``s3`` (a fresh bucket on the session's S3, Ceph's RADOS Gateway, reached by boto3
over HTTP, with 5 MiB parts so multipart paths are cheap). Nothing is mocked:
outages are real dead or silent sockets. After every failure path the tests
look at what was left behind (``StorageCase.leftovers``): the contract is that
a failed or aborted write leaves nothing at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import threading
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from itertools import pairwise

import blake3
import httpx
import pytest
from botocore.exceptions import ClientError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cgstore.core.errors import (
    BlobUnknown,
    BlobUploadUnknown,
    DigestInvalid,
    SizeInvalid,
    TooLarge,
    Unavailable,
)
from cgstore.storage import StagedUpload, open_storage
from cgstore.storage.fs import FileStorage
from cgstore.storage.hashing import READ_CHUNK_BYTES, blake3_digest, blob_key, parse_digest
from cgstore.storage.s3 import S3Storage
from cgstore.storage.s3 import driver as s3_driver
from cgstore.storage.s3 import staging as s3_staging
from cgstore.storage.s3.driver import COMPLETE_READ_TIMEOUT_S
from cgstore.storage.s3.errors import s3_errors
from cgstore.storage.s3.multipart import PartBuffers, ViewsReader
from tests.support.leftovers import staged_session_bytes
from tests.support.proxy import CuttableProxy
from tests.support.services import free_port, use_s3_credentials
from tests.support.storage_fixtures import (
    S3_TEST_CONCURRENCY,
    S3_TEST_PART_BYTES,
    S3_TEST_PREFIX,
    StorageCase,
    build_storage_case,
)

MiB = 1 << 20
PART = S3_TEST_PART_BYTES
NOTHING_LEFT = {"uploads": [], "tmp": [], "multipart": []}


# -- helpers ---------------------------------------------------------------------------


def chunked(data: bytes, size: int = 256 * 1024) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def write_blob(storage, data: bytes, *, declare_size: bool = True, chunk: int = 256 * 1024) -> int:
    with storage.writer(blake3_digest(data), len(data) if declare_size else None) as writer:
        for piece in chunked(data, chunk):
            writer.write(piece)
        return writer.commit()


def read_all(storage, digest: str, start: int = 0, end: int | None = None) -> bytes:
    return b"".join(storage.read(digest, start, end))


def stage(storage, pieces: list[bytes]) -> StagedUpload:
    """A session with one append per piece, its state round-tripped through JSON like the DB does."""
    return stage_more(storage, storage.stage_begin(uuid.uuid4().hex), pieces)


def stage_more(storage, staged: StagedUpload, pieces: list[bytes]) -> StagedUpload:
    """``staged`` with one more append per piece."""
    for piece in pieces:
        before, staged = staged, storage.stage_append(staged, chunked(piece, 64 * 1024))
        staged = StagedUpload(staged.session_id, staged.offset, json.loads(json.dumps(staged.state)))
        storage.stage_recorded(before, staged)  # what the service does once its compare-and-set won
    return staged


def s3_etag(case: StorageCase, digest: str) -> str:
    storage = case.storage
    return storage.client.head_object(Bucket=storage.bucket, Key=storage.blob_key(digest))["ETag"]


def assert_stored_once(case: StorageCase, data: bytes) -> None:
    digest = blake3_digest(data)
    assert case.keys("blobs") == [blob_key(parse_digest(digest))]
    assert case.storage.size(digest) == len(data)
    assert read_all(case.storage, digest) == data
    assert case.leftovers() == NOTHING_LEFT


def assert_nothing_stored(case: StorageCase, *digests: str) -> None:
    for digest in digests:
        assert case.storage.size(digest) is None
    assert case.keys("blobs") == []
    assert case.leftovers() == NOTHING_LEFT


@pytest.fixture(scope="module")
def big_data() -> bytes:
    """3.5 S3 parts: three full parts and a short last one."""
    return os.urandom(int(3.5 * PART))


# -- verified writes ----------------------------------------------------------------------


def test_open_storage_builds_the_configured_backend(storage_case):
    if storage_case.kind == "fs":
        assert isinstance(storage_case.storage, FileStorage)
        assert not storage_case.storage.supports_presign
    else:
        assert isinstance(storage_case.storage, S3Storage)
        assert storage_case.storage.prefix == S3_TEST_PREFIX + "/"
        assert storage_case.storage.part_bytes == PART
    storage_case.storage.ping()


@pytest.mark.parametrize("length", [0, 1, 1000, PART, PART + 1])
def test_write_commit_read_round_trip(storage_case, length):
    data = os.urandom(length)
    assert write_blob(storage_case.storage, data) == length
    assert_stored_once(storage_case, data)
    if storage_case.kind == "s3":
        # One part or less is a single verified PUT; more is a multipart upload.
        etag = s3_etag(storage_case, blake3_digest(data))
        assert etag.endswith('-2"') if length > PART else "-" not in etag


@pytest.mark.parametrize("declare_size", [True, False], ids=["size-declared", "size-unknown"])
def test_multipart_blob_round_trip(storage_case, big_data, declare_size):
    size = write_blob(storage_case.storage, big_data, declare_size=declare_size, chunk=777_777)
    assert size == len(big_data)
    assert_stored_once(storage_case, big_data)
    if storage_case.kind == "s3":
        assert s3_etag(storage_case, blake3_digest(big_data)).endswith('-4"')


def test_ranged_reads(storage_case):
    data = os.urandom(3 * MiB + 17)
    digest = blake3_digest(data)
    write_blob(storage_case.storage, data)
    n = len(data)
    ranges = {
        "start": (0, 100),
        "middle, across read chunks": (MiB - 5, 2 * MiB + 5),
        "suffix": (n - 100, None),
        "whole": (0, None),
        "end past the blob is clamped": (n - 10, n + 1000),
        "empty": (50, 50),
        "at the end": (n, None),
        "past the end": (n + 5, n + 10),
    }
    for name, (start, end) in ranges.items():
        assert read_all(storage_case.storage, digest, start, end) == data[start:end], name
    assert max(len(chunk) for chunk in storage_case.storage.read(digest)) <= READ_CHUNK_BYTES
    with pytest.raises(ValueError):
        storage_case.storage.read(digest, -1)
    with pytest.raises(ValueError):
        storage_case.storage.read(digest, 10, 5)


def test_absent_blob(storage_case):
    digest = blake3_digest(b"never written")
    assert storage_case.storage.size(digest) is None
    for start, end in [(0, None), (0, 10), (5, 5)]:
        with pytest.raises(BlobUnknown):
            storage_case.storage.read(digest, start, end)
    storage_case.storage.delete(digest)  # absent is not an error


def test_delete(storage_case):
    data = b"garbage collected"
    write_blob(storage_case.storage, data)
    storage_case.storage.delete(blake3_digest(data))
    assert_nothing_stored(storage_case, blake3_digest(data))


@pytest.mark.parametrize(
    "bad",
    ["sha256:" + "0" * 64, "blake3:" + "A" * 64, "blake3:abc", "", "blake3:" + "0" * 65, "blake3:" + "0" * 64 + "\n"],
)
def test_malformed_digest_is_digest_invalid(storage_case, bad):
    for call in (
        lambda: storage_case.storage.writer(bad),
        lambda: storage_case.storage.size(bad),
        lambda: storage_case.storage.read(bad),
        lambda: storage_case.storage.delete(bad),
    ):
        with pytest.raises(DigestInvalid):
            call()
    assert storage_case.leftovers() == NOTHING_LEFT


@pytest.mark.parametrize("length", [1000, int(2.5 * PART)], ids=["one-part", "multipart"])
def test_wrong_digest_leaves_nothing(storage_case, length):
    data = os.urandom(length)
    claimed = blake3_digest(data + b"!")
    writer = storage_case.storage.writer(claimed, length)
    for piece in chunked(data, MiB):
        writer.write(piece)
    with pytest.raises(DigestInvalid) as refused:
        writer.commit()
    assert refused.value.detail["actual"] == blake3_digest(data)
    writer.abort()  # safe after a failed commit
    assert_nothing_stored(storage_case, claimed, blake3_digest(data))


def test_stream_shorter_than_declared_size_is_size_invalid(storage_case):
    data = os.urandom(10_000)
    writer = storage_case.storage.writer(blake3_digest(data), len(data) + 1)
    writer.write(data)
    with pytest.raises(SizeInvalid):
        writer.commit()
    assert_nothing_stored(storage_case, blake3_digest(data))


def test_stream_longer_than_declared_size_is_refused_at_once(storage_case, big_data):
    declared = PART + 10
    writer = storage_case.storage.writer(blake3_digest(big_data[:declared]), declared)
    with pytest.raises(SizeInvalid):
        for piece in chunked(big_data, MiB):  # refused while writing: no need to swallow 17 MiB
            writer.write(piece)
    with pytest.raises(RuntimeError):
        writer.write(b"more")
    assert_nothing_stored(storage_case, blake3_digest(big_data[:declared]))


@pytest.mark.parametrize("how", ["abort", "exception in with-block"])
def test_abort_leaves_nothing(storage_case, big_data, how):
    digest = blake3_digest(big_data)
    writer = storage_case.storage.writer(digest)  # size unknown: a multipart upload opens on S3
    if how == "abort":
        for piece in chunked(big_data[: int(2.5 * PART)], MiB):
            writer.write(piece)
        writer.abort()
        writer.abort()  # idempotent
    else:
        with pytest.raises(ConnectionResetError), writer:
            for piece in chunked(big_data[: int(2.5 * PART)], MiB):
                writer.write(piece)
            raise ConnectionResetError("the client went away")
    assert_nothing_stored(storage_case, digest)


def test_s3_parts_upload_concurrently_and_in_flight_is_bounded(s3_server, tmp_path, big_data):
    case = build_storage_case("s3", tmp_path, s3_server)
    storage, lock = case.storage, threading.Lock()
    in_flight, most = 0, 0
    upload_part = storage.objects.upload_part

    def counted_upload_part(*args):  # our own call, counted; S3 is still the real one
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        try:
            time.sleep(0.05)  # long enough for the parts to overlap observably
            return upload_part(*args)
        finally:
            with lock:
                in_flight -= 1

    storage.objects.upload_part = counted_upload_part
    data = big_data * 2  # 7 parts
    write_blob(storage, data, chunk=MiB)
    assert 2 <= most <= S3_TEST_CONCURRENCY
    assert_stored_once(case, data)


def test_identical_concurrent_writes_both_succeed_and_store_one_blob(storage_case, big_data):
    barrier = threading.Barrier(2, timeout=60)
    sizes, errors = [], []

    def write() -> None:
        try:
            writer = storage_case.storage.writer(blake3_digest(big_data), len(big_data))
            barrier.wait()
            for piece in chunked(big_data, MiB):
                writer.write(piece)
            barrier.wait()  # both streams fully written before either commits
            sizes.append(writer.commit())
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sizes == [len(big_data)] * 2
    assert_stored_once(storage_case, big_data)


def test_size_limit_is_too_large(make_storage_case):
    case = make_storage_case(max_blob_bytes=1000)
    data = os.urandom(1001)
    with pytest.raises(TooLarge):
        case.storage.writer(blake3_digest(data), len(data))
    writer = case.storage.writer(blake3_digest(data))
    with pytest.raises(TooLarge):
        writer.write(data)
    staged = stage(case.storage, [data[:600]])
    with pytest.raises(TooLarge):
        case.storage.stage_append(staged, iter([data[600:]]))
    assert case.storage.stage_commit(staged, blake3_digest(data[:600])) == 600
    assert_stored_once(case, data[:600])


def test_a_stage_writer_counts_the_offset_against_the_limit_before_any_byte(make_storage_case):
    """A chunk under the limit alone but over it with its offset: refused up front when
    declared, and at its first byte over the limit when not; either way nothing more is staged."""
    case = make_storage_case(max_blob_bytes=1000)
    data = os.urandom(1000)
    staged = stage(case.storage, [data[:600]])
    with pytest.raises(TooLarge):
        case.storage.stage_writer(staged, 401)  # 401 <= 1000, 600 + 401 > 1000
    writer = case.storage.stage_writer(staged, None)
    with pytest.raises(TooLarge):
        writer.write(data[600:] + b"!")
    with case.storage.stage_writer(staged, 400) as writer:  # exactly up to the limit
        writer.write(data[600:])
        staged = writer.finish()
    assert case.storage.stage_commit(staged, blake3_digest(data)) == 1000
    assert_stored_once(case, data)


# -- staged uploads ---------------------------------------------------------------------------


def test_staged_upload_over_several_appends(storage_case, big_data):
    # Uneven pieces; one longer than a part (a multipart chunk object on S3).
    cuts = [0, 1, 1001, 1001 + PART + 123, 1001 + PART + 126, len(big_data)]
    pieces = [big_data[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    staged = stage(storage_case.storage, pieces)
    assert staged.offset == len(big_data)
    assert storage_case.keys("uploads")  # staged bytes exist until the commit
    assert storage_case.storage.stage_commit(staged, blake3_digest(big_data)) == len(big_data)
    assert_stored_once(storage_case, big_data)


def test_empty_staged_upload(storage_case):
    staged = stage(storage_case.storage, [b""])
    assert staged.offset == 0
    assert storage_case.storage.stage_commit(staged, blake3_digest(b"")) == 0
    assert_stored_once(storage_case, b"")


@pytest.mark.parametrize("fail_after", [10_000, PART + 10_000], ids=["small", "past-a-part"])
def test_append_failing_midway_stages_none_of_its_bytes(storage_case, big_data, fail_after):
    data = big_data[: 2 * PART]
    staged = stage(storage_case.storage, [data[:5000]])

    def dying_client() -> Iterator[bytes]:
        yield from chunked(data[5000 : 5000 + fail_after], 64 * 1024)
        raise ConnectionResetError("the client went away mid-chunk")

    with pytest.raises(ConnectionResetError):
        storage_case.storage.stage_append(staged, dying_client())
    assert storage_case.pending_multipart() == []
    if storage_case.kind == "fs":
        assert (storage_case.storage.uploads_dir / staged.session_id).stat().st_size == 5000
    # The client resumes from the recorded offset.
    staged = storage_case.storage.stage_append(staged, chunked(data[5000:]))
    assert storage_case.storage.stage_commit(staged, blake3_digest(data)) == len(data)
    assert_stored_once(storage_case, data)


def test_racing_append_at_the_same_offset_cannot_disturb_the_recorded_one(storage_case):
    """The service records offsets by compare-and-set after the append: the loser's bytes must be inert."""
    head = stage(storage_case.storage, [b"head"])
    winner = storage_case.storage.stage_append(head, iter([b"W" * 1000]))
    storage_case.storage.stage_append(head, iter([b"L" * 1500]))  # lost the compare-and-set
    final = storage_case.storage.stage_append(winner, iter([b"tail"]))
    data = b"head" + b"W" * 1000 + b"tail"
    assert storage_case.storage.stage_commit(final, blake3_digest(data)) == len(data)
    assert_stored_once(storage_case, data)  # the loser's bytes are reclaimed too


def test_a_losing_racer_as_the_last_append_before_commit_leaves_no_dead_tail(storage_case):
    """The loser's bytes follow the winner's and nothing was appended since: on the directory
    backend the commit is in place (live extents contiguous from 0), so it must cut them."""
    head = stage(storage_case.storage, [b"head"])
    winner = storage_case.storage.stage_append(head, iter([b"W" * 1000]))
    storage_case.storage.stage_append(head, iter([b"L" * 1500]))  # lost the compare-and-set, never discarded
    data = b"head" + b"W" * 1000
    assert storage_case.storage.stage_commit(winner, blake3_digest(data)) == len(data)
    assert_stored_once(storage_case, data)


def simulate_crashed_append(case: StorageCase, staged: StagedUpload, garbage: bytes) -> None:
    """What a process killed mid-append leaves: bytes the session never recorded."""
    if case.kind == "fs":
        with open(case.storage.uploads_dir / staged.session_id, "ab") as staging:
            staging.write(garbage)
        return
    storage, prefix = case.storage, case.storage.key(f"uploads/{staged.session_id}/")
    storage.client.put_object(Bucket=storage.bucket, Key=f"{prefix}{staged.offset:016d}-crashed", Body=garbage)
    key = f"{prefix}{staged.offset:016d}-killed"
    upload_id = storage.client.create_multipart_upload(Bucket=storage.bucket, Key=key)["UploadId"]
    storage.client.upload_part(Bucket=storage.bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=garbage)


def test_append_after_a_crashed_append_resumes_cleanly(storage_case):
    data = os.urandom(300_000)
    staged = stage(storage_case.storage, [data[:100_000]])
    simulate_crashed_append(storage_case, staged, b"\0" * 50_000)
    staged = storage_case.storage.stage_append(staged, chunked(data[100_000:]))
    assert storage_case.storage.stage_commit(staged, blake3_digest(data)) == len(data)
    assert_stored_once(storage_case, data)


def test_staged_commit_with_wrong_digest_leaves_nothing(storage_case, big_data):
    staged = stage(storage_case.storage, [big_data[:1000], big_data[1000 : 2 * PART]])
    wrong = blake3_digest(b"something else")
    with pytest.raises(DigestInvalid):
        storage_case.storage.stage_commit(staged, wrong)
    assert_nothing_stored(storage_case, wrong, blake3_digest(big_data[: 2 * PART]))
    with pytest.raises(BlobUploadUnknown):  # the staging was dropped with the mismatch
        storage_case.storage.stage_commit(staged, blake3_digest(big_data[: 2 * PART]))


def test_staged_commit_with_malformed_digest_keeps_the_session(storage_case):
    staged = stage(storage_case.storage, [b"abc", b"def"])
    with pytest.raises(DigestInvalid):
        storage_case.storage.stage_commit(staged, "blake3:nope")
    assert storage_case.storage.stage_commit(staged, blake3_digest(b"abcdef")) == 6
    assert_stored_once(storage_case, b"abcdef")


def test_stage_abort_reclaims_every_staged_byte(storage_case, big_data):
    staged = stage(storage_case.storage, [big_data[:1000], big_data[1000 : 2 * PART]])
    simulate_crashed_append(storage_case, staged, b"\0" * 50_000)
    assert storage_case.keys("uploads")
    storage_case.storage.stage_abort(staged)
    assert_nothing_stored(storage_case, blake3_digest(big_data[: 2 * PART]))
    storage_case.storage.stage_abort(staged)  # idempotent
    with pytest.raises(BlobUploadUnknown):
        storage_case.storage.stage_commit(staged, blake3_digest(big_data[: 2 * PART]))


def another_process(case: StorageCase):
    """The same store as another server process sees it: same bytes, none of this one's stream hashes."""
    return open_storage(case.settings)


def count_s3_calls(case: StorageCase | S3Storage, *operations: str) -> dict[str, int]:
    """Live counts of the S3 operations this storage's clients send (botocore's own event hooks)."""
    storage = case.storage if isinstance(case, StorageCase) else case
    counts = dict.fromkeys(operations, 0)
    for operation in operations:

        def count(operation=operation, **_):
            counts[operation] += 1

        for client in (storage.client, storage.objects.complete_client):
            client.meta.events.register(f"before-call.s3.{operation}", count)
    return counts


def test_staged_commit_verifies_from_the_hash_kept_by_the_appends(storage_case, big_data):
    """One process served every append: the commit reads nothing back, and on S3 the chunks
    are parts of the session's upload: the commit completes it and copies nothing but the
    last chunk (below 5 MiB, a chunk object) in as the last part."""
    pieces = [big_data[:PART], big_data[PART : 2 * PART + 7], big_data[2 * PART + 7 :]]
    staged = stage(storage_case.storage, pieces)
    assert storage_case.storage.staged_verifier(staged, blake3_digest(big_data)) is not None
    if storage_case.kind == "s3":
        calls = count_s3_calls(storage_case, "GetObject", "UploadPart", "UploadPartCopy", "CopyObject")
    assert storage_case.storage.stage_commit(staged, blake3_digest(big_data)) == len(big_data)
    if storage_case.kind == "s3":
        assert calls == {"GetObject": 0, "UploadPart": 0, "UploadPartCopy": 1, "CopyObject": 1}
    assert_stored_once(storage_case, big_data)


def test_staged_commit_in_another_process_reads_the_bytes_back(storage_case, big_data):
    pieces = [big_data[:PART], big_data[PART:]]
    staged = stage(storage_case.storage, pieces)
    other = another_process(storage_case)
    assert other.staged_verifier(staged, blake3_digest(big_data)) is None
    assert other.stage_commit(staged, blake3_digest(big_data)) == len(big_data)
    assert_stored_once(storage_case, big_data)


def test_an_append_in_another_process_leaves_no_hash_to_trust(storage_case, big_data):
    """A state this process did not produce names no kept hash, even if an earlier one did."""
    head = stage(storage_case.storage, [big_data[:PART]])
    moved = another_process(storage_case).stage_append(head, iter([big_data[PART:]]))
    assert storage_case.storage.staged_verifier(moved, blake3_digest(big_data)) is None
    assert storage_case.storage.stage_commit(moved, blake3_digest(big_data)) == len(big_data)
    assert_stored_once(storage_case, big_data)


def tamper_with_staged_bytes(case: StorageCase, staged: StagedUpload, cut: int = 0) -> None:
    """Flip the first byte of the staging (on S3: of its last chunk object, ``cut`` bytes shorter)."""
    if case.kind == "fs":
        path = case.storage.uploads_dir / staged.session_id
        data = bytearray(path.read_bytes())
        data[0] ^= 0xFF
        path.write_bytes(bytes(data))
        return
    storage = case.storage
    name = staged.state["chunks"][-1][2]
    assert isinstance(name, str), "the last entry is a chunk object"
    key = storage.key(f"uploads/{staged.session_id}/{name}")
    data = bytearray(storage.client.get_object(Bucket=storage.bucket, Key=key)["Body"].read())
    data[0] ^= 0xFF
    storage.client.put_object(Bucket=storage.bucket, Key=key, Body=bytes(data[: len(data) - cut]))


def test_staged_bytes_changed_in_storage_are_caught_when_read_back(storage_case, big_data):
    """A commit without the appends' hash completes the session's upload off the blob keys
    and reads it back: changed bytes never become a blob."""
    staged = stage(storage_case.storage, [big_data[:PART], big_data[PART:-1000], big_data[-1000:]])
    tamper_with_staged_bytes(storage_case, staged)
    with pytest.raises(DigestInvalid):
        another_process(storage_case).stage_commit(staged, blake3_digest(big_data))
    assert_nothing_stored(storage_case, blake3_digest(big_data))


@pytest.fixture
def s3_case(tmp_path, s3_server) -> StorageCase:
    return build_storage_case("s3", tmp_path, s3_server)


def test_a_staged_chunk_cut_short_in_s3_never_becomes_visible(s3_case, big_data):
    staged = stage(s3_case.storage, [big_data[:PART], big_data[PART:-1000], big_data[-1000:]])
    tamper_with_staged_bytes(s3_case, staged, cut=100)
    with pytest.raises(BlobUploadUnknown):
        s3_case.storage.stage_commit(staged, blake3_digest(big_data))  # its kept hash is of the real bytes
    assert s3_case.storage.size(blake3_digest(big_data)) is None
    assert s3_case.keys("blobs") == [] and not any("/blobs/" in key for key in s3_case.pending_multipart())
    s3_case.storage.stage_abort(staged)  # the session's staging stays until it is cancelled or reaped
    assert s3_case.leftovers() == NOTHING_LEFT


def replace_part(case: StorageCase, staged: StagedUpload, index: int, data: bytes) -> None:
    """Upload ``data`` over the recorded part ``index`` of the session's upload (same number)."""
    storage = case.storage
    _, _, number, _ = staged.state["chunks"][index]
    storage.client.upload_part(
        Bucket=storage.bucket,
        Key=storage.key(f"uploads/{staged.session_id}/parts"),
        UploadId=staged.state["upload"],
        PartNumber=number,
        Body=data,
    )


@pytest.mark.parametrize("same_process", [True, False])
def test_a_part_replaced_in_s3_never_completes(s3_case, big_data, same_process):
    """The state records each part's ETag: a part uploaded over a recorded one (what a racer
    that took the same number would do) fails the completion, whoever commits."""
    staged = stage(s3_case.storage, [big_data[:PART], big_data[PART:]])
    replace_part(s3_case, staged, 0, b"X" * PART)
    committer = s3_case.storage if same_process else another_process(s3_case)
    with pytest.raises(BlobUploadUnknown):
        committer.stage_commit(staged, blake3_digest(big_data))
    assert s3_case.storage.size(blake3_digest(big_data)) is None
    assert s3_case.keys("blobs") == []


def test_session_chunks_are_parts_of_one_upload_and_the_commit_copies_no_byte(s3_case, big_data):
    """Chunks of whole parts: each append uploads parts of the session's one multipart upload
    (none as an object), and the commit is one completion and one CopyObject."""
    pieces = [big_data[:PART], big_data[PART : 3 * PART], big_data[3 * PART :]]
    calls = count_s3_calls(s3_case, "UploadPart", "PutObject", "CreateMultipartUpload")
    staged = stage(s3_case.storage, pieces)
    # 4 parts (the last 0.5 PART is the last chunk: a tail object), one claim per part
    assert calls == {"UploadPart": 3, "PutObject": 3 + 1, "CreateMultipartUpload": 1}
    assert [len(entry) for entry in staged.state["chunks"]] == [4, 4, 4, 3]
    assert [entry[2] for entry in staged.state["chunks"][:3]] == [1, 2, 3]
    commit = count_s3_calls(
        s3_case, "GetObject", "UploadPart", "UploadPartCopy", "CopyObject", "CompleteMultipartUpload"
    )
    assert s3_case.storage.stage_commit(staged, blake3_digest(big_data)) == len(big_data)
    assert commit == {
        "GetObject": 0,
        "UploadPart": 0,
        "UploadPartCopy": 1,
        "CopyObject": 1,
        "CompleteMultipartUpload": 1,
    }
    assert_stored_once(s3_case, big_data)


def test_a_chunk_that_is_no_multiple_of_the_part_size_carries_its_rest_into_the_next(s3_case, big_data):
    """A 1.3-part chunk leaves 0.3 part (below 5 MiB) as a tail object; the next append starts its
    first part with it, so every recorded part stays above S3's floor and the commit joins them."""
    cut = int(1.3 * PART)
    staged = stage(s3_case.storage, [big_data[:cut]])
    assert [len(entry) for entry in staged.state["chunks"]] == [4, 3]
    staged = stage_more(s3_case.storage, staged, [big_data[cut:]])
    entries = staged.state["chunks"]
    assert all(len(entry) == 4 and entry[1] >= s3_staging.MIN_PART_BYTES for entry in entries[:-1])
    assert entries[1][0] == PART  # the carried tail's offset starts the next part
    other = another_process(s3_case)
    calls = count_s3_calls(other, "GetObject", "PutObject")
    assert other.stage_commit(staged, blake3_digest(big_data)) == len(big_data)
    assert calls["GetObject"] == 1  # the read-back of the completed object, nothing else
    assert_stored_once(s3_case, big_data)


def test_chunks_below_5_mib_are_carried_into_the_next_part(s3_case, big_data):
    """Small chunks, one after another, are no parts S3 could join (every part but the last must
    be 5 MiB): each is carried into the next append until a part is full."""
    staged = stage(s3_case.storage, [big_data[:1000], big_data[1000:2000]])
    # One tail object: the first (1000 bytes) was carried into the second, and dropped once recorded.
    assert staged_session_bytes(s3_case.storage, staged.session_id) == 2000
    staged = stage_more(s3_case.storage, staged, [big_data[2000:]])
    assert all(len(entry) == 4 for entry in staged.state["chunks"][:-1])  # the small ones were carried
    assert staged.state["chunks"][0][:2] == [0, PART]
    assert s3_case.storage.stage_commit(staged, blake3_digest(big_data)) == len(big_data)
    assert_stored_once(s3_case, big_data)


def test_a_session_staged_as_chunk_objects_before_this_layout_still_commits(s3_case, big_data):
    """Chunk objects in the middle (the layout before parts, a 1000-byte one among them): the
    commit streams them through a verified write."""
    storage, session_id = s3_case.storage, uuid.uuid4().hex
    chunks, offset = [], 0
    for i, piece in enumerate([big_data[:1000], big_data[1000:-4]]):
        name = f"{offset:016d}-legacy{i}"
        storage.client.put_object(Bucket=storage.bucket, Key=storage.key(f"uploads/{session_id}/{name}"), Body=piece)
        chunks.append([offset, len(piece), name])
        offset += len(piece)
    staged = stage_more(storage, StagedUpload(session_id, offset, {"chunks": chunks}), [big_data[-4:]])
    assert another_process(s3_case).stage_commit(staged, blake3_digest(big_data)) == len(big_data)
    assert_stored_once(s3_case, big_data)


def test_a_session_past_the_last_part_number_spills_into_chunk_objects(s3_case, big_data):
    """With no part number left, appends write chunk objects; the commit streams the parts
    (completed first) and the objects through a verified write."""
    s3_case.storage.staging.max_parts = 2
    pieces = [big_data[:PART], big_data[PART : 2 * PART], big_data[2 * PART : 3 * PART], big_data[3 * PART :]]
    staged = stage(s3_case.storage, pieces)
    kinds = [len(entry) for entry in staged.state["chunks"]]
    assert kinds == [4, 4, 3, 3]
    other = another_process(s3_case)
    calls = count_s3_calls(other, "UploadPart", "CompleteMultipartUpload")
    assert other.stage_commit(staged, blake3_digest(big_data)) == len(big_data)
    assert calls["CompleteMultipartUpload"] == 2  # the two parts, then the blob's verified write
    assert_stored_once(s3_case, big_data)


@pytest.mark.parametrize("same_process", [True, False])
def test_racing_appends_at_one_offset_never_share_a_part_number(s3_case, big_data, same_process):
    """Two appends from the same state, in threads, each with parts: the one recorded
    completes with its own bytes whatever order their parts landed in."""
    head = stage(s3_case.storage, [big_data[:PART]])
    racers = {b"W": big_data[PART : 3 * PART], b"L": os.urandom(2 * PART)}
    results: dict[bytes, StagedUpload] = {}

    def run(tag: bytes) -> None:
        results[tag] = s3_case.storage.stage_append(head, chunked(racers[tag], 64 * 1024))

    threads = [threading.Thread(target=run, args=(tag,)) for tag in racers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    numbers = {tag: [entry[2] for entry in staged.state["chunks"][1:]] for tag, staged in results.items()}
    assert not set(numbers[b"W"]) & set(numbers[b"L"]), numbers
    s3_case.storage.stage_discard(head, results[b"L"])  # the loser of the compare-and-set
    data = big_data[: 3 * PART]
    committer = s3_case.storage if same_process else another_process(s3_case)
    assert committer.stage_commit(results[b"W"], blake3_digest(data)) == len(data)
    assert_stored_once(s3_case, data)


def test_an_append_killed_after_its_parts_leaves_nothing_the_commit_keeps(s3_case, big_data):
    """A process killed after sending parts but before its state was recorded: the parts sit
    in the session's upload under numbers no state names, and the next append does not reuse them."""
    storage = s3_case.storage
    head = stage(storage, [big_data[:PART]])
    killed = storage.stage_writer(head)
    killed.write(os.urandom(2 * PART + 1))  # two parts cut and sent; then the process dies: no finish, no abort
    key = storage.key(f"uploads/{head.session_id}/parts")
    deadline = time.monotonic() + 60
    while len(storage.client.list_parts(Bucket=storage.bucket, Key=key, UploadId=head.state["upload"])["Parts"]) < 3:
        assert time.monotonic() < deadline, "the killed append's parts never landed"
        time.sleep(0.1)
    staged = storage.stage_append(head, iter([big_data[PART:]]))
    assert staged.state["chunks"][1][2] > 2  # above the numbers the killed append took
    assert another_process(s3_case).stage_commit(staged, blake3_digest(big_data)) == len(big_data)
    assert_stored_once(s3_case, big_data)


def test_copy_ranges_split_what_one_copy_cannot_take():
    assert s3_staging.copy_ranges(0) == [(0, 0)]
    assert s3_staging.copy_ranges(6 * MiB) == [(0, 6 * MiB)]
    huge = 11 << 30  # over two 5 GiB parts: three equal ranges
    ranges = s3_staging.copy_ranges(huge)
    assert len(ranges) == 3 and all(end - start <= s3_staging.MAX_PART_BYTES for start, end in ranges)
    assert ranges[0][0] == 0 and ranges[-1][1] == huge
    assert all(a[1] == b[0] for a, b in pairwise(ranges))  # contiguous


def test_stream_hashes_forget_the_oldest_and_never_answer_for_another_offset():
    from cgstore.storage.hashing import STREAM_HASH_FIELD, StreamHashes, StreamState

    hashes = StreamHashes(limit=2)
    tokens = []
    for data in (b"a", b"bb", b"ccc"):
        state = StreamState()
        state.update(data)
        tokens.append(hashes.keep(state))
    assert hashes.resume({STREAM_HASH_FIELD: tokens[0]}, 1) is None  # evicted
    assert hashes.resume({STREAM_HASH_FIELD: tokens[1]}, 3) is None  # not the recorded offset
    resumed = hashes.resume({STREAM_HASH_FIELD: tokens[2]}, 3)
    assert resumed.hasher.hexdigest() == blake3.blake3(b"ccc").hexdigest()
    resumed.update(b"more")  # a copy: the kept state is unchanged
    assert hashes.resume({STREAM_HASH_FIELD: tokens[2]}, 3).size == 3
    assert hashes.resume({}, 3) is None and hashes.resume({}, 0).size == 0


@pytest.mark.parametrize("session_id", ["../escape", "a/b", ".hidden", "", "x" * 200, "abc\n"])
def test_unsafe_session_ids_are_unknown(storage_case, session_id):
    staged = StagedUpload(session_id, 0, {})
    for call in (
        lambda: storage_case.storage.stage_begin(session_id),
        lambda: storage_case.storage.stage_append(staged, iter([b"x"])),
        lambda: storage_case.storage.stage_commit(staged, blake3_digest(b"")),
        lambda: storage_case.storage.stage_abort(staged),
    ):
        with pytest.raises(BlobUploadUnknown):
            call()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.binary(max_size=4000),
    cuts=st.lists(st.integers(0, 4000), max_size=5),
    start=st.integers(0, 4500),
    length=st.none() | st.integers(0, 4500),
)
def test_any_chunking_and_any_range_round_trip(storage_case, data, cuts, start, length):
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    pieces = [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    digest = blake3_digest(data)
    with storage_case.storage.writer(digest, len(data)) as writer:
        for piece in pieces:
            writer.write(piece)
        assert writer.commit() == len(data)
    staged = stage(storage_case.storage, pieces)
    assert storage_case.storage.stage_commit(staged, digest) == len(data)
    end = None if length is None else start + length
    assert read_all(storage_case.storage, digest, start, end) == data[start:end]


# -- presigned URLs -------------------------------------------------------------------------------


def test_presigned_url_downloads_identical_bytes(storage_case):
    data = os.urandom(PART + 1000)
    digest = blake3_digest(data)
    write_blob(storage_case.storage, data)
    url = storage_case.storage.presigned_url(digest, 60)
    if storage_case.kind == "fs":
        assert url is None  # the fs backend streams through the store itself
        return
    assert "X-Amz-Expires=60" in url
    response = httpx.get(url, timeout=30)
    assert response.status_code == 200
    assert response.content == data


def test_presigned_url_names_the_public_endpoint(s3_server, tmp_path):
    public = s3_server.endpoint_url.replace("127.0.0.1", "localhost")
    case = build_storage_case("s3", tmp_path, s3_server, s3_public_endpoint_url=public)
    data = b"served straight from object storage"
    write_blob(case.storage, data)
    url = case.storage.presigned_url(blake3_digest(data), 60)
    assert url.startswith(public + "/")
    assert httpx.get(url, timeout=30).content == data


# -- outages ----------------------------------------------------------------------------------------


def assert_unavailable_quickly(name: str, operation) -> None:
    started = time.monotonic()
    with pytest.raises(Unavailable):
        operation()
    assert time.monotonic() - started < 10, name


def test_dead_s3_is_unavailable_within_seconds(s3_server, tmp_path, big_data):
    """The S3 a storage was using disappears (its door is closed: every connection dropped, none accepted)."""
    with contextlib.closing(CuttableProxy(int(s3_server.endpoint_url.rsplit(":", 1)[1]))) as door:
        doomed = dataclasses.replace(s3_server, endpoint_url=f"http://127.0.0.1:{door.port}")
        case = build_storage_case("s3", tmp_path, doomed)
        storage = case.storage
        kept = b"written before the outage"
        write_blob(storage, kept)
        staged = stage(storage, [b"staged before the outage"])
        in_flight = storage.writer(blake3_digest(big_data), len(big_data))
        for piece in chunked(big_data[: PART + MiB], MiB):  # one part uploaded
            in_flight.write(piece)
        door.cut()

        def finish_in_flight() -> None:
            for piece in chunked(big_data[PART + MiB :], MiB):
                in_flight.write(piece)
            in_flight.commit()

        operations = {
            "ping": storage.ping,
            "size": lambda: storage.size(blake3_digest(kept)),
            "read": lambda: read_all(storage, blake3_digest(kept)),
            "ranged read": lambda: read_all(storage, blake3_digest(kept), 2, 5),
            "delete": lambda: storage.delete(blake3_digest(kept)),
            "small write": lambda: write_blob(storage, b"lost"),
            "multipart write already under way": finish_in_flight,
            "stage_append": lambda: storage.stage_append(staged, iter([b"more"])),
            "stage_commit": lambda: storage.stage_commit(staged, blake3_digest(b"staged before the outage")),
            "stage_abort": lambda: storage.stage_abort(staged),
            "sweep_orphans": lambda: storage.sweep_orphans(0),
        }
        for name, operation in operations.items():
            assert_unavailable_quickly(name, operation)


def test_unreachable_endpoint_is_unavailable(s3_server, tmp_path):
    use_s3_credentials(s3_server)
    storage = S3Storage("bucket", endpoint_url=f"http://127.0.0.1:{free_port()}", region="us-east-1")
    assert_unavailable_quickly("ping", storage.ping)
    assert_unavailable_quickly("write", lambda: write_blob(storage, b"x"))


def test_silent_s3_times_out_as_unavailable(s3_server):
    """A store that accepts connections and never answers: bounded by read timeout × attempts."""
    use_s3_credentials(s3_server)
    with socket.create_server(("127.0.0.1", 0), backlog=16) as silent:
        port = silent.getsockname()[1]
        storage = S3Storage(
            "bucket", endpoint_url=f"http://127.0.0.1:{port}", region="us-east-1", read_timeout_s=0.5, max_attempts=2
        )
        assert_unavailable_quickly("size", lambda: storage.size(blake3_digest(b"x")))


def test_missing_bucket_is_unavailable(s3_server):
    use_s3_credentials(s3_server)
    storage = S3Storage("no-such-bucket-here", endpoint_url=s3_server.endpoint_url, region="us-east-1")
    assert_unavailable_quickly("ping", storage.ping)
    assert_unavailable_quickly("write", lambda: write_blob(storage, b"x"))


@pytest.mark.parametrize(
    ("code", "status"),
    [("SlowDown", 503), ("InternalError", 500), ("ServiceUnavailable", 503), ("AccessDenied", 403), ("Bad", 502)],
)
def test_store_side_error_answers_are_unavailable(code, status):
    answer = {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}
    with pytest.raises(Unavailable), s3_errors("put_object"):
        raise ClientError(answer, "PutObject")


def test_other_client_errors_are_not_disguised_as_outages():
    answer = {"Error": {"Code": "InvalidArgument", "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": 400}}
    with pytest.raises(ClientError), s3_errors("put_object"):
        raise ClientError(answer, "PutObject")


# -- orphans of dead processes ----------------------------------------------------------------------------


def start_multipart_write(storage, data: bytes):
    """A writer with its multipart upload open on S3 (one part sent, more bytes gathered)."""
    writer = storage.writer(blake3_digest(data), len(data))
    for piece in chunked(data[: PART + MiB], MiB):
        writer.write(piece)
    return writer


def test_sweep_orphans_reclaims_writes_of_dead_processes(storage_case, big_data):
    # The dead process is another storage over the same store: its writes are nobody's.
    dead = open_storage(storage_case.settings)
    orphan = start_multipart_write(dead, big_data)  # its process "dies" mid-write
    assert storage_case.keys("tmp") or storage_case.pending_multipart()
    # A young write is not an orphan (S3 dates a multipart upload by its creation).
    assert storage_case.storage.sweep_orphans(3600) == 0
    time.sleep(0.01)
    assert storage_case.storage.sweep_orphans(0) == 1
    orphan.abort()  # still safe
    assert_nothing_stored(storage_case, blake3_digest(big_data))


def test_s3_sweep_spares_the_writes_in_flight_of_its_own_process(s3_server, tmp_path, big_data):
    """A sweep of everything (threshold 0) takes every upload for old: only knowing our own writers keeps them alive."""
    case = build_storage_case("s3", tmp_path, s3_server)
    live = start_multipart_write(case.storage, big_data)
    dead_data = os.urandom(2 * PART)
    orphan = start_multipart_write(S3Storage.from_settings(case.settings), dead_data)  # a dead process's
    assert len(case.pending_multipart()) == 2

    assert case.storage.sweep_orphans(0) == 1
    assert case.pending_multipart() == [case.storage.blob_key(blake3_digest(big_data))]
    assert case.storage.sweep_orphans(0) == 0  # every tick, not just the first
    for piece in chunked(big_data[PART + MiB :], MiB):
        live.write(piece)
    assert live.commit() == len(big_data)
    orphan.abort()  # its upload is gone already; this only stops its threads
    assert_stored_once(case, big_data)


def test_s3_sweep_reclaims_a_writer_its_own_process_abandoned(s3_server, tmp_path, big_data, monkeypatch):
    """Ours, but idle for longer than the threshold and the grace: abandoned (a stuck request)."""
    monkeypatch.setattr(s3_driver, "LIVE_WRITER_GRACE_S", 1.0)  # instead of waiting 5 s
    case = build_storage_case("s3", tmp_path, s3_server)
    abandoned = start_multipart_write(case.storage, big_data)
    assert case.storage.sweep_orphans(0) == 0  # idle for less than the grace
    deadline = time.monotonic() + 15
    while (swept := case.storage.sweep_orphans(0)) == 0:  # once its part is uploaded and the grace over
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert swept == 1
    abandoned.abort()
    assert_nothing_stored(case, blake3_digest(big_data))


def test_s3_sweep_racing_the_creation_of_an_upload_spares_it(s3_server, tmp_path, big_data):
    """A sweep listing between CreateMultipartUpload's answer and the writer noting its id."""
    case = build_storage_case("s3", tmp_path, s3_server)
    swept = []

    def sweep_before_the_writer_sees_the_answer(**_) -> None:
        swept.append(case.storage.sweep_orphans(0))

    case.storage.client.meta.events.register(
        "after-call.s3.CreateMultipartUpload", sweep_before_the_writer_sees_the_answer
    )
    assert write_blob(case.storage, big_data) == len(big_data)
    assert swept == [0]
    assert_stored_once(case, big_data)


# -- completing multipart uploads --------------------------------------------------------------------


def complete_hook(case: StorageCase, action: str) -> dict[str, list]:
    """Just before the storage's own CompleteMultipartUpload goes out, act on its upload
    out-of-band with a plain boto3 client:

    - "complete": an earlier attempt completed it and its answer was lost. moto answers a
      repeated complete by itself while the object it made is untouched, so the object is
      then rewritten with the same bytes (as an identical concurrent write would): moto
      no longer knows the upload, like S3 after a completion.
    - "abort": the upload vanished (a sweep of another process, a lifecycle rule).

    Returns what happened: upload ids acted on, and the error codes the storage's own
    complete got back.
    """
    raw, seen = case.s3.client(), {"acted": [], "errors": []}

    def out_of_band(params, **_) -> None:
        upload = {"Bucket": params["Bucket"], "Key": params["Key"], "UploadId": params["UploadId"]}
        if action == "complete":
            raw.complete_multipart_upload(**upload, MultipartUpload=params["MultipartUpload"])
            body = raw.get_object(Bucket=params["Bucket"], Key=params["Key"])["Body"].read()
            raw.put_object(Bucket=params["Bucket"], Key=params["Key"], Body=body)
        else:
            raw.abort_multipart_upload(**upload)
        seen["acted"].append(params["UploadId"])

    def answered(parsed, **_) -> None:
        if "Error" in parsed:
            seen["errors"].append(parsed["Error"].get("Code"))

    for client in (case.storage.client, case.storage.objects.complete_client):
        client.meta.events.register("before-parameter-build.s3.CompleteMultipartUpload", out_of_band)
        client.meta.events.register("after-call.s3.CompleteMultipartUpload", answered)
    return seen


def test_s3_complete_already_done_by_an_earlier_attempt_succeeds(s3_server, tmp_path, big_data):
    case = build_storage_case("s3", tmp_path, s3_server)
    seen = complete_hook(case, "complete")
    assert write_blob(case.storage, big_data) == len(big_data)
    assert len(seen["acted"]) == 1
    assert seen["errors"]  # the storage's own complete did fail (moto: 500, S3: NoSuchUpload)
    assert_stored_once(case, big_data)


def test_s3_complete_of_a_vanished_upload_is_unavailable_and_leaves_nothing(s3_server, tmp_path, big_data):
    case = build_storage_case("s3", tmp_path, s3_server)
    seen = complete_hook(case, "abort")
    with pytest.raises(Unavailable):
        write_blob(case.storage, big_data)
    assert len(seen["acted"]) == 1 and seen["errors"]
    assert_nothing_stored(case, blake3_digest(big_data))


class SlowCompleteProxy:
    """A TCP relay to the S3 that holds back every answer to CompleteMultipartUpload
    (``POST <key>?uploadId=…``) by ``delay_s`` and counts those requests: S3 assembling a
    big object slowly, as seen from the client."""

    def __init__(self, endpoint_url: str, delay_s: float) -> None:
        self._upstream = ("127.0.0.1", int(endpoint_url.rsplit(":", 1)[1]))
        self._delay_s = delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint_url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.completes = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(self._upstream)
            answer_late = threading.Event()
            threading.Thread(target=self._relay, args=(client, upstream, answer_late, True), daemon=True).start()
            threading.Thread(target=self._relay, args=(upstream, client, answer_late, False), daemon=True).start()

    def _relay(self, source: socket.socket, sink: socket.socket, answer_late: threading.Event, requests: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if requests and data.startswith(b"POST ") and b"uploadId=" in data.split(b"\r\n", 1)[0]:
                    self.completes += 1
                    answer_late.set()
                elif not requests and answer_late.is_set():
                    answer_late.clear()
                    time.sleep(self._delay_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)


def test_s3_slow_complete_is_waited_for_not_retried(s3_server, tmp_path, big_data):
    """A complete slower than the read timeout must not be cut short and sent again."""
    case = build_storage_case("s3", tmp_path, s3_server)
    proxy = SlowCompleteProxy(s3_server.endpoint_url, delay_s=2.5)
    try:
        slow = S3Storage(
            case.storage.bucket,
            prefix=case.storage.prefix,
            endpoint_url=proxy.endpoint_url,
            region=s3_server.region,
            part_bytes=PART,
            read_timeout_s=1.0,
        )
        assert COMPLETE_READ_TIMEOUT_S > 2.5
        assert write_blob(slow, big_data) == len(big_data)
        assert proxy.completes == 1
    finally:
        proxy.close()
    assert_stored_once(case, big_data)


# -- memory ----------------------------------------------------------------------------------------------


def test_memory_stays_bounded_for_a_256_mib_blob(storage_case):
    """Write and read back 256 MiB streamed from a generator; the peak must be a few parts, not the blob."""
    count, block = 256, os.urandom(MiB)

    def stream() -> Iterator[bytes]:
        for i in range(count):  # a fresh 1 MiB object per chunk, like a request body
            yield i.to_bytes(8, "big") + block[8:]

    hasher = blake3.blake3()
    for chunk in stream():
        hasher.update(chunk)
    digest, size = "blake3:" + hasher.hexdigest(), count * MiB

    tracemalloc.start()
    try:
        with storage_case.storage.writer(digest, size) as writer:
            for chunk in stream():
                writer.write(chunk)
            assert writer.commit() == size
        read_back = blake3.blake3()
        for chunk in storage_case.storage.read(digest):
            read_back.update(chunk)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "blake3:" + read_back.hexdigest() == digest
    # By design an S3 write uses (concurrency + 1) pooled part buffers, plus its
    # first part's chunks until it outgrows one PUT, plus a chunk or two; fs
    # holds a chunk or two.
    if storage_case.kind == "s3":
        bound = (S3_TEST_CONCURRENCY + 2) * PART + 4 * MiB
    else:
        bound = 6 * MiB
    assert peak < bound, f"peak {peak / MiB:.1f} MiB for a {size // MiB} MiB blob (bound {bound / MiB:.1f})"


def generated_stream(seed: int, size: int, block: bytes) -> Iterator[bytes]:
    """``size`` bytes as fresh chunks of up to 1 MiB, like a request body: distinct per
    ``seed``, and none kept alive by the caller."""
    for offset in range(0, size, MiB):
        chunk = seed.to_bytes(8, "big") + offset.to_bytes(8, "big") + block[16:]
        yield chunk[: min(MiB, size - offset)]


def write_generated(storage, seed: int, size: int, block: bytes) -> int:
    hasher = blake3.blake3()
    for chunk in generated_stream(seed, size, block):
        hasher.update(chunk)
    with storage.writer("blake3:" + hasher.hexdigest(), size) as writer:
        for chunk in generated_stream(seed, size, block):
            writer.write(chunk)
        return writer.commit()


def test_s3_part_buffers_are_pooled_reused_and_bounded(s3_server, tmp_path):
    """Part buffers come from the storage's pool: sequential writes reuse the same few, and
    concurrent writes never hold more than the pool's bound (they wait for one instead)."""
    case = build_storage_case("s3", tmp_path, s3_server)
    storage, buffers = case.storage, case.storage.objects.buffers
    assert buffers.limit == max(8, 2 * S3_TEST_CONCURRENCY)
    most_allocated, done = 0, threading.Event()

    def watch_pool() -> None:
        nonlocal most_allocated
        while not done.is_set():
            most_allocated = max(most_allocated, buffers.allocated)
            time.sleep(0.001)

    block = os.urandom(MiB)
    watcher = threading.Thread(target=watch_pool)
    watcher.start()
    tracemalloc.start()
    try:
        # Sequential: one writer needs at most concurrency + 1 buffers, and the
        # next writers reuse them; traced memory does not grow with the count.
        current = []
        for seed in range(8):
            assert write_generated(storage, seed, int(2.5 * PART), block) == int(2.5 * PART)
            current.append(tracemalloc.get_traced_memory()[0])
            assert buffers.allocated <= S3_TEST_CONCURRENCY + 1
        assert current[-1] - current[0] < MiB, [round(c / MiB, 1) for c in current]
        assert current[-1] <= buffers.allocated * PART + 2 * MiB

        # Concurrent: 6 writers want 6 × (concurrency + 1) = 24 buffers; the pool has 8.
        tracemalloc.reset_peak()
        writers, errors = 6, []

        def write(seed: int) -> None:
            try:
                write_generated(storage, seed, int(3.5 * PART), block)
            except BaseException as exc:  # reported in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(100 + i,)) for i in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        done.set()
        watcher.join()
    assert errors == []
    assert most_allocated <= buffers.limit
    # The pool, plus each writer's first part (kept as its chunks until it outgrows
    # one PUT) and a chunk in hand; without the pool it would be 6 × 4 parts.
    bound = buffers.limit * PART + writers * (PART + 2 * MiB) + 8 * MiB
    assert peak < bound, f"peak {peak / MiB:.1f} MiB (bound {bound / MiB:.1f})"
    assert case.leftovers() == NOTHING_LEFT


def test_part_buffers_wait_for_a_release_and_give_up_in_time():
    buffers = PartBuffers(limit=2, wait_s=1.0)
    first, second = buffers.acquire(10), buffers.acquire(10)
    got = []
    waiter = threading.Thread(target=lambda: got.append(buffers.acquire(10)))
    waiter.start()
    time.sleep(0.2)
    assert got == []  # both lent: it waits
    buffers.release(first)
    waiter.join(timeout=5)
    assert got[0] is first  # handed over, not reallocated
    started = time.monotonic()
    with pytest.raises(Unavailable):  # nothing comes back: it gives up after wait_s
        buffers.acquire(10)
    assert 0.9 < time.monotonic() - started < 5
    buffers.release(second)
    bigger = buffers.acquire(20)  # an idle buffer of another size makes room
    assert len(bigger) == 20 and buffers.allocated == 2


def test_views_reader_reads_across_views_and_rewinds():
    data = os.urandom(1000)
    backing = bytearray(data)
    views = [memoryview(backing)[0:1], memoryview(backing)[1:400], memoryview(data)[400:1000]]
    reader = ViewsReader(views)
    assert len(reader) == 1000
    assert b"".join(iter(lambda: reader.read(64), b"")) == data
    assert reader.read(10) == b""
    assert reader.seek(0) == 0 and reader.read() == data
    reader.seek(-3, 2)
    assert reader.tell() == 997 and reader.read(100) == data[997:]
    reader.seek(399)
    assert reader.read(2) == data[399:401]
    assert ViewsReader([]).read() == b""


def test_s3_connection_pool_keeps_a_connection_for_every_request_thread(s3_server, tmp_path, caplog):
    """As many concurrent reads as the store has request threads return their connections
    to the pool instead of discarding them ("Connection pool is full": reconnects under load)."""
    threads = 24  # more than the 4 x max_concurrency the pool once held
    case = build_storage_case("s3", tmp_path, s3_server, worker_threads=threads)
    data = os.urandom(1024)
    write_blob(case.storage, data)
    digest = blake3_digest(data)
    caplog.set_level("WARNING", logger="urllib3.connectionpool")
    readers = [case.storage.read(digest) for _ in range(threads)]  # each holds a connection
    assert all(b"".join(reader) == data for reader in readers)  # and gives it back at the end
    assert not [r for r in caplog.records if "pool is full" in r.getMessage()]
