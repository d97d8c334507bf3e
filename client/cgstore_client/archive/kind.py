"""What an input *is*, decided from magic bytes and names before anything is parsed.

The only accepted kind is ``aot-inductor`` (format ``pt2``: a zip). The
retired kind ``torch-inductor-cache`` (a captured ``TORCHINDUCTOR_CACHE_DIR``
plus ``TRITON_CACHE_DIR``, shipped as a tarball, a zip or a directory) is
refused *by name* so its refusal is readable; anything else is refused as
unsupported. Extensions are never trusted: a ``.pt2`` that is really a
gzip is detected as a gzip.

Sniffing a tarball decompresses at most ``Limits.max_sniff_bytes`` and lists
at most ``Limits.max_sniff_members`` names; a directory walk lists at most
``Limits.max_sniff_members`` entries and never follows symlinks.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import tarfile
import zlib
from collections.abc import Iterable
from typing import BinaryIO

from cgstore_client.archive.errors import KindRetired, KindUnsupported
from cgstore_client.archive.zipsafe import Limits

__all__ = [
    "FORMAT_ZIP",
    "RETIRED_KIND",
    "looks_like_inductor_cache",
    "refuse_non_zip",
    "sniff_format",
]

RETIRED_KIND = "torch-inductor-cache"
FORMAT_ZIP = "zip"

_HEAD_BYTES = 512
_TAR_MAGIC_OFFSET = 257
_MAGICS: tuple[tuple[bytes, str], ...] = (
    (b"PK\x03\x04", FORMAT_ZIP),
    (b"PK\x05\x06", FORMAT_ZIP),  # an empty zip: still a zip, refused later for having no entries
    (b"\x1f\x8b", "gzip"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
)
_DECOMPRESSORS = {"gzip": gzip.GzipFile, "bzip2": bz2.BZ2File, "xz": lzma.LZMAFile}

# Directory names a TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR capture contains
# (fxgraph and aotautograd caches, the triton cache, precompiled headers, the
# inductor cache root itself) and file suffixes only a triton cache holds.
_CACHE_DIR_NAMES = frozenset(
    {"fxgraph", "aotautograd", "triton", "inductor", "torchinductor", "precompiled_headers", "pgo", "dynamo_pgo"}
)
_CACHE_DIR_PREFIXES = ("torchinductor_", "triton_cache")
_CACHE_FILE_SUFFIXES = (".cubin", ".ptx", ".ttir", ".ttgir", ".llir", ".hsaco", ".best_config")
_TRITON_GROUP_PREFIX = "__grp__"


def sniff_format(head: bytes) -> str | None:
    """The container format named by an input's first bytes, or ``None`` when none is recognized."""
    for magic, name in _MAGICS:
        if head.startswith(magic):
            return name
    if len(head) >= _TAR_MAGIC_OFFSET + 5 and head[_TAR_MAGIC_OFFSET : _TAR_MAGIC_OFFSET + 5] == b"ustar":
        return "tar"
    return None


def looks_like_inductor_cache(names: Iterable[str]) -> bool:
    """True when any path is laid out like an inductor or triton cache capture."""
    for name in names:
        components = [component for component in name.replace("\\", "/").split("/") if component not in ("", ".")]
        for component in components[:-1]:
            if component in _CACHE_DIR_NAMES or component.startswith(_CACHE_DIR_PREFIXES):
                return True
        leaf = components[-1] if components else ""
        if leaf.endswith(_CACHE_FILE_SUFFIXES) or leaf.startswith(_TRITON_GROUP_PREFIX):
            return True
    return False


def _retired(what: str) -> KindRetired:
    return KindRetired(
        f"{what} is a {RETIRED_KIND!r} artifact: that kind is retired and refused; "
        "only 'aot-inductor' (.pt2) compiled graphs are accepted"
    )


def _unsupported(what: str) -> KindUnsupported:
    return KindUnsupported(f"{what} is not a compiled graph: only 'aot-inductor' (.pt2 zip) archives are accepted")


class _CappedReader(io.RawIOBase):
    """A read-only stream that reports end of file after ``cap`` bytes: bounds any decompressor behind it."""

    def __init__(self, inner: BinaryIO, cap: int) -> None:
        self._inner = inner
        self._left = cap

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        if self._left <= 0:
            return 0
        view = memoryview(buffer)[: self._left]
        data = self._inner.read(len(view))
        view[: len(data)] = data
        self._left -= len(data)
        return len(data)


def _tar_member_names(stream: BinaryIO, limits: Limits) -> list[str]:
    """Up to ``max_sniff_members`` names from a tar stream; a truncated or broken tail ends the listing."""
    names: list[str] = []
    capped = io.BufferedReader(_CappedReader(stream, limits.max_sniff_bytes))
    try:
        with tarfile.open(fileobj=capped, mode="r|") as archive:
            for member in archive:
                names.append(member.name)
                if len(names) >= limits.max_sniff_members:
                    break
    except (tarfile.TarError, EOFError, OSError, ValueError, lzma.LZMAError, zlib.error):
        pass  # a truncated or corrupt tail: the names read so far are all the evidence there is
    return names


def _open_decompressor(fmt: str, raw: BinaryIO) -> BinaryIO:
    if fmt == "gzip":
        return gzip.GzipFile(fileobj=raw)
    return _DECOMPRESSORS[fmt](raw)  # type: ignore[return-value]


def _compressed_tar_names(path: str, fmt: str, limits: Limits) -> list[str] | None:
    """Member names when ``path`` is a compressed tarball, ``None`` when the payload is not a tar."""
    if fmt not in _DECOMPRESSORS:
        return None  # zstd: not in the stdlib; it cannot be an inductor-cache tarball we ever wrote
    with open(path, "rb") as raw:
        try:
            head = _open_decompressor(fmt, raw).read(_HEAD_BYTES)
        except (OSError, EOFError, lzma.LZMAError, zlib.error):
            return None
    if sniff_format(head) != "tar":
        return None
    with open(path, "rb") as raw:
        return _tar_member_names(_open_decompressor(fmt, raw), limits)


def _directory_names(path: str, limits: Limits) -> list[str]:
    names: list[str] = []
    for top, dirs, files in os.walk(path, followlinks=False):
        relative = os.path.relpath(top, path)
        for name in [*dirs, *files]:
            names.append(os.path.normpath(os.path.join(relative, name)))
            if len(names) >= limits.max_sniff_members:
                return names
    return names


def refuse_non_zip(path: str, limits: Limits) -> None:
    """Return when ``path`` is a regular file that starts like a zip; otherwise raise the kind refusal.

    Raises :class:`KindRetired` for a tarball, zip-less compressed tarball or
    directory laid out like an inductor cache, :class:`KindUnsupported` for
    anything else that is not a zip.
    """
    if os.path.isdir(path):
        if looks_like_inductor_cache(_directory_names(path, limits)):
            raise _retired("this directory")
        raise _unsupported("a directory")
    if not os.path.isfile(path):
        raise _unsupported(f"{path!r} (not a regular file)")
    with open(path, "rb") as fh:
        head = fh.read(_HEAD_BYTES)
    fmt = sniff_format(head)
    if fmt == FORMAT_ZIP:
        return
    if fmt == "tar":
        with open(path, "rb") as fh:
            names: list[str] | None = _tar_member_names(fh, limits)
    elif fmt is not None:
        names = _compressed_tar_names(path, fmt, limits)
    else:
        names = None
    if names is not None and looks_like_inductor_cache(names):
        raise _retired(f"this tarball ({fmt})")
    raise _unsupported(f"this {fmt or 'unrecognized'} file" if names is None else f"this tarball ({fmt})")
