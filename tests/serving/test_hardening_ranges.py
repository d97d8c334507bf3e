"""Issue 9, classes 2 and 5: the ``Range`` grammar of RFC 9110 §14, as properties.

A strategy builds range headers of every form the grammar has (int ranges,
open ranges, suffix ranges, other units, several ranges, numbers of thousands
of digits, garbage), renders them with the spellings the grammar allows, and a
reference model written from the RFC says what each must answer for a blob of
a given size. The parser is checked over many sizes; the HTTP route over blob
sizes 0, 1 and larger on both configurations (S3 without redirects, so the
store itself answers the ranged read).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cgstore.core.errors import RangeInvalid
from cgstore.core.http import MAX_ECHO_CHARS, parse_range
from tests.blobs.test_blobs_api import digest_of
from tests.support.live_store import CONFIGURATIONS, unique_repo

WHOLE = "whole"
UNSATISFIABLE = "416"


@dataclass(frozen=True)
class Case:
    header: str
    form: str
    numbers: tuple[int, ...] = ()


def expected(case: Case, size: int) -> str | tuple[int, int]:
    """What RFC 9110 §14 (and the store's documented choices) answer: whole, 416, or ``(start, end)``."""
    if case.form == "other-unit":
        return WHOLE  # §14.2: an unknown range unit is ignored
    if case.form == "int":
        first, last = case.numbers
        if last < first or first >= size:
            return UNSATISFIABLE
        return first, min(last, size - 1) + 1
    if case.form == "open":
        (first,) = case.numbers
        return UNSATISFIABLE if first >= size else (first, size)
    if case.form == "suffix":
        (length,) = case.numbers
        # On an empty blob a suffix selects no byte that a Content-Range could name.
        return UNSATISFIABLE if length == 0 or size == 0 else (max(size - length, 0), size)
    return UNSATISFIABLE  # several ranges (not supported), oversized numbers, malformed


def _numbers() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 1100), st.integers(0, 10**19 - 1))


_unit = st.sampled_from(["bytes", "Bytes", "BYTES"])


def _int_range():
    return st.tuples(_unit, _numbers(), _numbers()).map(lambda t: Case(f"{t[0]}={t[1]}-{t[2]}", "int", (t[1], t[2])))


def _open_range():
    return st.tuples(_unit, _numbers()).map(lambda t: Case(f"{t[0]}={t[1]}-", "open", (t[1],)))


def _suffix_range():
    return st.tuples(_unit, _numbers()).map(lambda t: Case(f"{t[0]}=-{t[1]}", "suffix", (t[1],)))


def _other_unit():
    units = st.from_regex(r"[a-z][a-z0-9]{0,8}", fullmatch=True).filter(lambda u: u != "bytes")
    return st.tuples(units, _numbers()).map(lambda t: Case(f"{t[0]}=0-{t[1]}", "other-unit"))


def _several_ranges():
    return st.lists(st.tuples(st.integers(0, 50), st.integers(50, 100)), min_size=2, max_size=4).map(
        lambda spans: Case("bytes=" + ", ".join(f"{a}-{b}" for a, b in spans), "several")
    )


def _huge_number():
    digits = st.integers(20, 5000).map(lambda n: "9" * n)
    shapes = st.sampled_from(["bytes={}-", "bytes=-{}", "bytes=0-{}", "bytes={}-{}"])
    return st.tuples(shapes, digits).map(lambda t: Case(t[0].format(t[1], t[1]), "huge"))


def _garbage():
    # Bytes HTTP allows in a field value: visible ASCII, space, and obs-text (0x80-0xFF).
    text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40)
    # Only what is *not* "<digits>-<digits>" after the unit: the model calls it malformed.
    return text.filter(lambda t: re.fullmatch(r"\d*-\d*", t, re.ASCII) is None or t == "-").map(
        lambda t: Case(f"bytes={t}", "garbage")
    )


range_cases = st.one_of(
    _int_range(), _open_range(), _suffix_range(), _other_unit(), _several_ranges(), _huge_number(), _garbage()
)


@settings(max_examples=2000, deadline=None)
@given(case=range_cases, size=st.one_of(st.sampled_from([0, 1, 2, 1000]), st.integers(0, 2**40)))
def test_parser_follows_the_grammar(case, size):
    want = expected(case, size)
    try:
        got = parse_range(case.header, size)
    except RangeInvalid as err:
        assert want == UNSATISFIABLE, (case, size, err.message)
        assert len(err.detail["range"]) <= MAX_ECHO_CHARS
        return
    assert want == (WHOLE if got is None else got), (case, size)


def test_suffix_range_on_the_empty_blob_is_unsatisfiable():
    with pytest.raises(RangeInvalid):
        parse_range("bytes=-1", 0)


BLOB_SIZES = (0, 1, 1000)


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_ranged_reads_over_http_follow_the_grammar(make_registry, configuration):
    # A registry of its own: on the session database another store may have linked the same
    # small blobs (the empty one) with their bytes in another bucket.
    live = make_registry(configuration, redirect_downloads=False)
    name = unique_repo()
    token = live.mint("alice", f"acme/{name}:read,write")
    blobs = {size: os.urandom(size) for size in BLOB_SIZES}
    with live.client(token) as client:
        for data in blobs.values():
            assert client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(data)}", content=data).status_code == 201

        @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(case=range_cases, size=st.sampled_from(BLOB_SIZES))
        def check(case, size):
            data = blobs[size]
            url = f"/v1/repos/acme/{name}/blobs/{digest_of(data)}"
            answer = client.get(url, headers={"Range": case.header.encode("latin-1")})
            want = expected(case, size)
            if want == WHOLE:
                assert answer.status_code == 200 and answer.content == data
            elif want == UNSATISFIABLE:
                assert answer.status_code == 416, (case, answer.status_code)
                assert answer.json()["error"]["code"] == "RANGE_INVALID"
                assert answer.headers["content-range"] == f"bytes */{size}"
                assert len(answer.json()["error"]["detail"]["range"]) <= MAX_ECHO_CHARS
            else:
                start, end = want
                assert answer.status_code == 206, (case, answer.status_code)
                assert answer.content == data[start:end]
                assert answer.headers["content-range"] == f"bytes {start}-{end - 1}/{size}"

        check()
        # The regression the issue names: 206 with "bytes 0--1/0" before.
        empty = client.get(f"/v1/repos/acme/{name}/blobs/{digest_of(b'')}", headers={"Range": "bytes=-1"})
        assert empty.status_code == 416


def test_huge_content_range_is_a_json_416(store):
    name = unique_repo()
    token = store.mint("alice", f"acme/{name}:read,write")
    with store.client(token) as client:
        location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
        for header in ("0-" + "9" * 5000, "9" * 5000 + "-1", "0-1/" + "9" * 5000):
            answer = client.patch(location, content=b"ab", headers={"Content-Range": header})
            assert answer.status_code == 416
            assert answer.json()["error"]["code"] == "RANGE_INVALID"
            assert len(answer.json()["error"]["detail"]["content_range"]) <= MAX_ECHO_CHARS
        assert client.get(location).headers["upload-offset"] == "0"
