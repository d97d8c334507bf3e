"""What the audit stores: escaped, bounded text any database accepts (pure functions)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from cgstore.audit.service import DETAIL_JSON_BYTES, DETAIL_STRING_LEN, clean, clean_detail

HOSTILE = st.text(st.one_of(st.characters(), st.sampled_from(["\x00", "\ud800", "\udfff", "\\", "\x7f", "\n", "\x1b"])))


def test_nul_control_and_backslash_are_escaped_unambiguously():
    assert clean("a\x00b", 100) == "a\\x00b"
    assert clean("line\nbreak\x1b[31m", 100) == "line\\x0abreak\\x1b[31m"
    # A literal backslash is doubled, so the text "\x00" and a NUL stay distinguishable.
    assert clean("\\x00", 100) == "\\\\x00"
    assert clean("\\x00", 100) != clean("\x00", 100)


def test_lone_surrogates_and_undecodable_bytes_are_escaped():
    assert clean("x\ud800y", 100) == "x\\ud800y"
    assert clean(b"ok\xff\xfe", 100) == "ok\\xff\\xfe"
    # Non-ASCII is written as its code points, so a homoglyph never passes for ASCII in the log.
    assert clean("rоot ✓", 100) == "r\\u043eot \\u2713"
    assert clean("\U0001f600", 100) == "\\U0001f600"


def test_overlong_values_are_cut_with_a_marker():
    cut = clean("a" * 5000, 512)
    assert len(cut) == 512
    assert cut.endswith("…[cut from 5000 chars]")
    # Escaping can make a short value long: that is cut too.
    assert len(clean("\x00" * 400, 512)) == 512


@given(HOSTILE, st.integers(min_value=32, max_value=600))
def test_clean_output_is_bounded_and_storable(text, limit):
    out = clean(text, limit)
    assert len(out) <= limit
    out.encode("utf-8")  # no surrogate survives
    assert not any(ord(c) < 0x20 or ord(c) == 0x7F for c in out)
    if len(text) <= limit and text == clean(text, 10**6):
        assert out == text


def test_detail_is_cleaned_recursively_and_bounded():
    detail = clean_detail({"k\x00": ["v\ud800", float("nan"), {"deep": b"\xff"}], "n": 3, "ok": True})
    assert detail == {"k\\x00": ["v\\ud800", "nan", {"deep": "\\xff"}], "n": 3, "ok": True}
    json.dumps(detail, allow_nan=False)
    huge = clean_detail({f"k{i}": "x" * DETAIL_STRING_LEN for i in range(30)})
    assert huge["cut"] is True and len(json.dumps(huge).encode()) < DETAIL_JSON_BYTES
