"""Safetensors component headers, read statically: every malformed header is a named refusal."""

from __future__ import annotations

import json
import struct

import pytest

from cgstore_client.components import MAX_HEADER_BYTES, ComponentInvalid, encode_header, read_header


def blob(document: object, data: bytes = b"", *, raw: bytes | None = None) -> bytes:
    header = raw if raw is not None else json.dumps(document).encode()
    return struct.pack("<Q", len(header)) + header + data


def test_a_well_formed_header_names_dtypes_shapes_and_offsets():
    data = encode_header({"pos": ("F32", [2, 3]), "mask": ("BOOL", [4])}, {"source": "mint"}) + bytes(28)
    header = read_header(data, len(data))
    assert [(t.name, t.dtype, t.shape, t.begin, t.end) for t in header.tensors] == [
        ("pos", "float32", (2, 3), 0, 24),
        ("mask", "bool", (4,), 24, 28),
    ]
    assert header.metadata == {"source": "mint"}


@pytest.mark.parametrize(
    "data,reason",
    [
        (b"\x01\x02", "8-byte header length"),
        (struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "exceeds the limit"),
        (struct.pack("<Q", 100) + b"{}", "past the end"),
        (blob(None, raw=b"\xff\xfe"), "not strict JSON"),
        (
            blob(None, raw=b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}', data=bytes(4)),
            "not strict JSON",
        ),
        (blob([]), "must be a JSON object"),
        (blob({"a": {"dtype": "F32", "shape": [1]}}), "exactly dtype, shape and data_offsets"),
        (blob({"a": {"dtype": "PICKLE", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)), "not a safetensors dtype"),
        (blob({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)), "non-negative ints"),
        (blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4)), "do not hold"),
        (blob({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)), "starts at 4, expected 0"),
        (
            blob(
                {
                    "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                },
                bytes(8),
            ),
            "expected 4",
        ),
        (blob({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(12)), "holds 12 data bytes"),
        (blob({"__metadata__": {"k": 1}}), "__metadata__"),
    ],
    ids=[
        "short",
        "huge-header",
        "past-end",
        "not-utf8",
        "duplicate-key",
        "not-object",
        "missing-field",
        "unknown-dtype",
        "negative-dim",
        "size-mismatch",
        "gap",
        "overlap",
        "trailing-bytes",
        "bad-metadata",
    ],
)
def test_malformed_headers_are_refused_by_reason(data, reason):
    with pytest.raises(ComponentInvalid, match=reason):
        read_header(data, len(data))
