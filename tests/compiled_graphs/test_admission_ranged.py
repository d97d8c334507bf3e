"""Admission reads a stored archive in place, by ranges: the same report and the same refusals
as reading the whole file, without fetching the entries no check reads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cgstore.compiled_graphs.admission import inspect_stored
from cgstore.core.errors import StoreError
from cgstore.storage.ranged import RangedFile
from cgstore_client.archive import inspect, inspect_zip
from tests.hostile.corpus import ROOT, HostileCase, build_corpus, rewrite

pytestmark = pytest.mark.torch

PADDING_BYTES = 32 << 20


def _ranges_of(path: Path, log: list[tuple[int, int]] | None = None):
    def read_range(start: int, end: int):
        if log is not None:
            log.append((start, end))
        with open(path, "rb") as source:
            source.seek(start)
            yield source.read(end - start)

    return read_range


@pytest.fixture(scope="module")
def padded(pt2_archive: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real archive with a large stored AOTI file beside its shared object (a .pt2's bulk)."""
    out = tmp_path_factory.mktemp("ranged") / "padded.pt2"
    padding = bytes(16) + os.urandom(PADDING_BYTES - 16)  # zero first bytes: no pickle magic
    return rewrite(pt2_archive, out, add=[(f"{ROOT}/data/aotinductor/model/padding.bin", padding)])


def test_a_ranged_read_reports_what_the_file_read_does_and_skips_the_bulk(padded: Path) -> None:
    fetched: list[tuple[int, int]] = []
    size = padded.stat().st_size
    report = inspect_stored(_ranges_of(padded, fetched), size)
    assert report == inspect(padded)
    assert "data/aotinductor/model/padding.bin" in report.aoti_files
    # The padding's head is sniffed (pickle magic), its 32 MiB are never fetched.
    assert sum(end - start for start, end in fetched) < size - PADDING_BYTES + (4 << 20)


def test_a_ranged_file_reads_whole_headers_across_block_boundaries(padded: Path) -> None:
    data = padded.read_bytes()
    ranged = RangedFile(_ranges_of(padded), len(data))
    for start, length in [(0, 30), (65_530, 30), (65_536 * 3 - 1, 2), (len(data) - 22, 100), (1 << 20, 3 << 20)]:
        ranged.seek(start)
        assert ranged.read(length) == data[start : start + length]
        assert ranged.tell() == min(start + length, len(data))
    assert ranged.seek(-22, os.SEEK_END) == len(data) - 22


@pytest.fixture(scope="module")
def hostile(pt2_archive: Path, tmp_path_factory: pytest.TempPathFactory) -> list[HostileCase]:
    cases = build_corpus(pt2_archive, tmp_path_factory.mktemp("hostile-ranged"))
    return [case for case in cases if case.path.is_file()]  # a store holds blobs, never directories


def test_every_hostile_file_is_refused_by_ranges_for_the_reason_a_file_read_gives(hostile: list[HostileCase]) -> None:
    assert len(hostile) >= 35
    for case in hostile:
        with pytest.raises(StoreError) as refused:
            inspect_stored(_ranges_of(case.path), case.path.stat().st_size)
        assert refused.value.detail["reason"] == case.error.__name__, f"{case.name}: {refused.value}"


def test_a_stream_that_is_no_zip_is_refused_by_inspect_zip(hostile: list[HostileCase]) -> None:
    tarball = next(case for case in hostile if case.name == "inductor-cache.tar.gz")
    size = tarball.path.stat().st_size
    with pytest.raises(Exception) as refused:
        inspect_zip(RangedFile(_ranges_of(tarball.path), size))
    assert type(refused.value).__name__ == "KindUnsupported"
