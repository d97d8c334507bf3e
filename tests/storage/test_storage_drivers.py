"""The drivers as plain object stores, and verification written once above them (issue 10, item 1).

Each driver only streams bytes to a key and publishes or discards them, reads
ranges, stats, lists by prefix with a cursor, deletes and presigns; it knows
nothing of digests. ``Storage.writer`` (``storage/writer.py``) verifies for
every driver alike. Run on both drivers (``storage_case``: a directory and a
real bucket of the session's S3, Ceph's RADOS Gateway, under a key prefix).
"""

from __future__ import annotations

import os

import pytest

from cgstore.core.errors import DigestInvalid, TooLarge
from cgstore.storage.base import ObjectMissing
from cgstore.storage.hashing import blake3_digest, blob_key, parse_digest
from cgstore.storage.writer import VerifiedWriter


def put(storage, key: str, data: bytes) -> None:
    pending = storage.open_write(key, len(data))
    pending.write(data)
    pending.publish()


def test_driver_put_stat_read_delete_by_key(storage_case):
    storage = storage_case.storage
    data = os.urandom(70_000)
    pending = storage.open_write("misc/one", len(data))
    pending.write(data[:30_000])
    pending.write(data[30_000:])
    assert storage.stat("misc/one") is None  # nothing visible before publish
    pending.publish()
    assert storage.stat("misc/one") == len(data)
    assert b"".join(storage.read_range("misc/one")) == data
    assert b"".join(storage.read_range("misc/one", 100, 200)) == data[100:200]
    storage.delete_key("misc/one")
    storage.delete_key("misc/one")  # absent is not an error
    assert storage.stat("misc/one") is None
    with pytest.raises(ObjectMissing):
        storage.read_range("misc/one")


def test_discarded_write_leaves_nothing(storage_case):
    storage = storage_case.storage
    pending = storage.open_write("misc/never", None)
    pending.write(os.urandom(10_000))
    pending.discard()
    pending.discard()  # idempotent
    assert storage.stat("misc/never") is None
    assert storage_case.leftovers()["tmp"] == [] and storage_case.pending_multipart() == []


def test_list_by_prefix_pages_with_a_cursor(storage_case):
    storage = storage_case.storage
    blobs = [os.urandom(1000 + i) for i in range(7)]
    for data in blobs:
        with storage.writer(blake3_digest(data), len(data)) as writer:
            writer.write(data)
            writer.commit()
    put(storage, "misc/elsewhere", b"not a blob")
    expected = {blob_key(parse_digest(blake3_digest(data))): len(data) for data in blobs}
    seen: list = []
    cursor = None
    pages = 0
    while True:
        page, cursor = storage.list_keys("blobs/", cursor, limit=3)
        assert len(page) <= 3
        seen += page
        pages += 1
        if cursor is None:
            break
    assert pages >= 3
    assert {info.key: info.size for info in seen} == expected
    assert len(seen) == len(expected)  # no key listed twice across pages
    one = next(iter(expected))
    assert [info.key for info in storage.list_keys(one)[0]] == [one]
    assert storage.list_keys("nothing-here/")[0] == []


def test_verification_is_the_same_above_every_driver(storage_case, make_storage_case):
    storage = storage_case.storage
    data = os.urandom(5000)
    writer = storage.writer(blake3_digest(b"other"), len(data))
    assert isinstance(writer, VerifiedWriter)
    writer.write(data)
    with pytest.raises(DigestInvalid):
        writer.commit()
    assert storage.size(blake3_digest(b"other")) is None
    assert storage_case.leftovers() == {"uploads": [], "tmp": [], "multipart": []}
    limited = make_storage_case(max_blob_bytes=100).storage
    with pytest.raises(TooLarge):
        limited.writer(blake3_digest(data), len(data))
    staged = limited.stage_begin("limit" + "0" * 27)
    with pytest.raises(TooLarge):
        limited.stage_append(staged, iter([b"x" * 60, b"y" * 60]))
