"""Named CAS components: safetensors headers read statically, never a pickle, and the one writer.

A component is a safetensors file: an 8-byte little-endian header length, a
JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}``, then the tensor bytes. ``read_header`` takes the
first bytes of the blob (at most ``8 + max_header_bytes``) and its total size,
and checks what the safetensors spec requires: a bounded, strict JSON header;
dtypes from the spec; offsets that tile the data region contiguously, from 0
to its end, each tensor's byte length matching dtype x shape. Nothing is
executed or unpickled; tensor bytes are never read.

Dtype names are given as torch spells them (``float32``...), the spelling of
the archive's binding table, so a component's tensor can be compared with the
program constant it binds.

:func:`save_tensors` is the package's one safetensors writer (the mint's
derived constants, tests' checkpoints): the contract side and the worker side
both import it from here.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cgstore_client.errors import CgstoreError
from cgstore_client.keys import strict_json_loads

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__all__ = [
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "ComponentHeader",
    "ComponentInvalid",
    "TensorInfo",
    "read_header",
    "save_tensors",
]

#: Headers beyond this are refused (the reference implementation's own bound is 100 MB).
MAX_HEADER_BYTES = 16 << 20
#: Tensors per component.
MAX_TENSORS = 100_000
_MAX_RANK = 16

#: The safetensors spec's dtypes with whole-byte elements -> (torch spelling, bytes per element).
SAFETENSORS_DTYPES: Mapping[str, tuple[str, int]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "F32": ("float32", 4),
    "C64": ("complex64", 8),
    "F64": ("float64", 8),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
}


class ComponentInvalid(CgstoreError):
    """A component blob that is not a well-formed safetensors file (store code ``ARTIFACT_INVALID``)."""

    code = "ARTIFACT_INVALID"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class ComponentHeader:
    tensors: tuple[TensorInfo, ...]
    metadata: Mapping[str, str]
    header_bytes: int


def header_length(prefix: bytes, blob_size: int, max_header_bytes: int = MAX_HEADER_BYTES) -> int:
    """The JSON header's length from the first 8 bytes, bounded by the limit and the blob."""
    if len(prefix) < 8 or blob_size < 8:
        raise ComponentInvalid("a safetensors file starts with an 8-byte header length")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > max_header_bytes:
        raise ComponentInvalid(f"safetensors header of {length} bytes exceeds the limit of {max_header_bytes}")
    if 8 + length > blob_size:
        raise ComponentInvalid("safetensors header length runs past the end of the blob")
    return length


def read_header(prefix: bytes, blob_size: int, *, max_header_bytes: int = MAX_HEADER_BYTES) -> ComponentHeader:
    """Parse and check the header in ``prefix`` (the blob's first ``8 + header length`` bytes or more)."""
    length = header_length(prefix, blob_size, max_header_bytes)
    raw = prefix[8 : 8 + length]
    if len(raw) != length:
        raise ComponentInvalid("safetensors header is truncated")
    try:
        document = strict_json_loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ComponentInvalid(f"safetensors header is not strict JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ComponentInvalid("safetensors header must be a JSON object")
    metadata = _metadata(document.pop("__metadata__", {}))
    if len(document) > MAX_TENSORS:
        raise ComponentInvalid(f"more than {MAX_TENSORS} tensors in one component")
    tensors = [_tensor(name, entry) for name, entry in document.items()]
    _check_tiling(tensors, blob_size - 8 - length)
    return ComponentHeader(tuple(tensors), metadata, length)


def _metadata(value: object) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ComponentInvalid("safetensors __metadata__ must map strings to strings")
    return value


def _tensor(name: str, entry: object) -> TensorInfo:
    if not name or len(name) > 1024:
        raise ComponentInvalid(f"tensor name {name[:80]!r} is empty or too long")
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise ComponentInvalid(f"tensor {name!r}: an entry has exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in SAFETENSORS_DTYPES:
        raise ComponentInvalid(f"tensor {name!r}: dtype {str(dtype)[:20]!r} is not a safetensors dtype")
    if not isinstance(shape, list) or len(shape) > _MAX_RANK or not all(_is_count(d) for d in shape):
        raise ComponentInvalid(f"tensor {name!r}: shape must be a list of non-negative ints")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise ComponentInvalid(f"tensor {name!r}: data_offsets must be [begin, end]")
    torch_dtype, item_size = SAFETENSORS_DTYPES[dtype]
    begin, end = offsets
    if end < begin or end - begin != math.prod(shape) * item_size:
        raise ComponentInvalid(f"tensor {name!r}: data_offsets {offsets} do not hold {dtype} x {shape}")
    return TensorInfo(name, torch_dtype, tuple(shape), begin, end)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _check_tiling(tensors: list[TensorInfo], data_bytes: int) -> None:
    """Tensors cover the data region exactly: contiguous, no gap, no overlap, ending at the blob's end."""
    position = 0
    for tensor in sorted(tensors, key=lambda t: (t.begin, t.end)):
        if tensor.begin != position:
            raise ComponentInvalid(f"tensor {tensor.name!r} starts at {tensor.begin}, expected {position}")
        position = tensor.end
    if position != data_bytes:
        raise ComponentInvalid(f"tensor data ends at {position} but the blob holds {data_bytes} data bytes")


def encode_header(tensors: Mapping[str, tuple[str, list[int]]], metadata: Mapping[str, str] | None = None) -> bytes:
    """The first bytes of a safetensors file holding ``{name: (safetensors dtype, shape)}`` in order.

    Used by minting tools and tests to write components without torch; the
    tensor bytes (in the same order) follow it.
    """
    document: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    position = 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * SAFETENSORS_DTYPES[dtype][1]
        document[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, position + size]}
        position += size
    header = json.dumps(document, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the reference writer pads to 8-byte alignment
    return struct.pack("<Q", len(header)) + header


def save_tensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """Write ``tensors`` as a safetensors file without numpy (``safetensors.torch`` needs it; a worker may not)."""
    from safetensors import TensorSpec, serialize_file

    kept = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    specs = {
        name: TensorSpec(
            dtype=str(t.dtype).removeprefix("torch."), shape=t.shape, data_ptr=t.data_ptr(), data_len=t.nbytes
        )
        for name, t in kept.items()
    }
    serialize_file(specs, os.fspath(path), metadata=None)  # ``kept`` keeps every pointer alive until here
