"""Hostile and inadmissible inputs: each refused with its specific error, in bounded time and memory."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import pytest

from cgstore_client.archive import ArchiveError, inspect
from tests.hostile.corpus import HostileCase, build_corpus

pytestmark = pytest.mark.torch

#: Peak Python allocations while refusing any case (the 50 MB JSON and the 128 MiB bomb included);
#: measured peaks are about 2 MiB, the bound leaves room for interpreter noise, not for a buffered entry.
MAX_PEAK_BYTES = 8 << 20
#: Wall-clock bound per refusal; measured refusals take under 50 ms (tracemalloc on).
MAX_SECONDS = 3.0


@pytest.fixture(scope="session")
def hostile_corpus(pt2_archive: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, HostileCase]:
    cases = build_corpus(pt2_archive, tmp_path_factory.mktemp("hostile"))
    return {case.name: case for case in cases}


def _case_names() -> list[str]:
    # The names are fixed by the corpus; building it needs the real archive, so list them statically.
    return [
        "zip-bomb.pt2",
        "lying-sizes.pt2",
        "dotdot.pt2",
        "absolute.pt2",
        "backslash.pt2",
        "duplicate.pt2",
        "truncated.pt2",
        "program-50mb.pt2",
        "program-deep.pt2",
        "program-nan.pt2",
        "program-duplicate-key.pt2",
        "symlink.pt2",
        "encrypted.pt2",
        "overlapping.pt2",
        "too-many-entries.pt2",
        "prepended.pt2",
        "appended.pt2",
        "inductor-cache.tar.gz",
        "inductor-cache-named.pt2",
        "inductor-cache.zip",
        "inductor-cache-dir",
        "random.pt2",
        "empty.pt2",
        "plain.tar.gz",
        "not-pt2.zip",
        "weights.pt2",
        "constants.pt2",
        "weights-blob.pt2",
        "sample-inputs.pt2",
        "hidden-pickle.pt2",
        "constants-in-so.pt2",
        "two-roots.pt2",
        "unexpected-entry.pt2",
        "no-program.pt2",
        "unknown-version.pt2",
        "no-metadata.pt2",
        "bad-metadata.pt2",
        "retired-kind-metadata.pt2",
        "sm-mismatch.pt2",
        "not-a-program.pt2",
    ]


def test_the_corpus_is_the_listed_one(hostile_corpus: dict[str, HostileCase]) -> None:
    assert sorted(hostile_corpus) == sorted(_case_names())


@pytest.mark.parametrize("name", _case_names())
def test_each_hostile_archive_is_refused_specifically_and_cheaply(
    name: str, hostile_corpus: dict[str, HostileCase]
) -> None:
    case = hostile_corpus[name]
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ArchiveError) as refused:
            inspect(case.path)
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The exact class, not a parent: the reason must be readable from the type alone.
    assert type(refused.value) is case.error, f"{case.about}: {type(refused.value).__name__}: {refused.value}"
    assert refused.value.code == case.error.code
    assert str(refused.value)
    assert elapsed < MAX_SECONDS, f"{case.about}: {elapsed:.2f}s"
    assert peak < MAX_PEAK_BYTES, f"{case.about}: peak {peak / 2**20:.1f} MiB"


def test_the_retired_kind_is_refused_by_name(hostile_corpus: dict[str, HostileCase]) -> None:
    with pytest.raises(ArchiveError, match="torch-inductor-cache") as refused:
        inspect(hostile_corpus["inductor-cache.tar.gz"].path)
    assert refused.value.code == "KIND_RETIRED"


def test_the_big_json_is_refused_before_it_is_read(hostile_corpus: dict[str, HostileCase]) -> None:
    case = hostile_corpus["program-50mb.pt2"]
    assert case.path.stat().st_size > 50 << 20
    with pytest.raises(case.error, match="refused without parsing"):
        inspect(case.path)


def test_a_metadata_refusal_carries_the_schema_error(hostile_corpus: dict[str, HostileCase]) -> None:
    with pytest.raises(ArchiveError) as refused:
        inspect(hostile_corpus["bad-metadata.pt2"].path)
    assert refused.value.code == "METADATA_INVALID"
    assert refused.value.metadata_error is not None  # type: ignore[attr-defined]
    assert "built_at" in str(refused.value)
