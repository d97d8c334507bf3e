"""Open an untrusted zip so that nothing in it is read before everything about it is vetted.

:class:`SafeZip` is the only way the archive reader touches a zip. Opening one
checks, in this order and before any entry's data is decompressed:

1. the file is a regular file within ``Limits.max_archive_bytes``;
2. the end-of-central-directory record (zip64 included) exists and declares at
   most ``Limits.max_entries`` entries in a central directory of at most
   ``Limits.max_central_directory_bytes``, so a forged count cannot make the
   stdlib parser allocate millions of records;
3. every central-directory entry: a safe ASCII relative name (no absolute
   path, drive letter, backslash, ``.``/``..``/empty component or control
   character), a regular file or directory (never a symlink or device), not
   encrypted, stored or deflated only, within the per-entry and total size
   limits, a deflate ratio within ``Limits.max_compression_ratio``, and no
   duplicate names;
4. every local header agrees with the central directory on its name, and no
   two entries' data overlap (the overlapping-file bomb) or run into the
   central directory;
5. optionally (``Limits.verify_entries``, on by default) every entry is
   streamed once in bounded chunks to check its CRC and its real size
   (``Limits.verify_stored_entries`` off: deflated entries only, whose real
   size only inflating tells; a stored entry's real size is its stored size,
   checked in 4., and its bytes are CRC-checked whenever a reader reads them
   whole).

The zip is a path, or any seekable binary file object (the store reads a stored
archive through ranged reads that way, never spooling the entries it does not
read).

Reads after that are bounded too: :meth:`SafeZip.read_bytes` and
:meth:`SafeZip.read_json` refuse a record larger than the caller's cap from
its declared size, then count real bytes while streaming.

Memory stays proportional to the central directory (at most ``max_entries``
records) plus the largest record a caller chooses to read, never to an
entry's expanded size.
"""

from __future__ import annotations

import io
import os
import re
import stat
import struct
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, BinaryIO

from cgstore_client.archive.errors import (
    ArchiveBomb,
    ArchiveDuplicateEntry,
    ArchiveEncrypted,
    ArchiveMalformed,
    ArchiveOverlappingEntries,
    ArchivePathUnsafe,
    ArchiveSymlink,
    ArchiveTooLarge,
    ArchiveTruncated,
    JsonInvalid,
    JsonTooDeep,
    JsonTooLarge,
)
from cgstore_client.keys import strict_json_loads

__all__ = ["DEFAULT_LIMITS", "Limits", "SafeZip", "check_json_depth", "parse_json_strict"]

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Limits:
    """Every bound the static reader enforces. The defaults suit one weight-free compiled graph.

    A weight-free ``.pt2`` holds a serialized program (JSON), generated C++
    and one or a few shared objects: hundreds of megabytes at most. The
    generous size defaults exist so the store can still refuse a misbuilt
    archive with a precise reason instead of running out of disk or memory.
    """

    #: The archive file itself.
    max_archive_bytes: int = 64 * GIB
    #: Entries in the central directory (torch writes about a dozen).
    max_entries: int = 10_000
    #: Bytes of central directory, checked from the end record before parsing it.
    max_central_directory_bytes: int = 16 * MIB
    #: Uncompressed bytes of any one entry.
    max_entry_bytes: int = 16 * GIB
    #: Uncompressed bytes of all entries together.
    max_total_bytes: int = 64 * GIB
    #: Uncompressed/compressed ratio allowed for a deflated entry ...
    max_compression_ratio: int = 100
    #: ... once it expands beyond this size (tiny records legitimately compress very well).
    compression_ratio_floor_bytes: int = 1 * MIB
    #: An entry name, in bytes, and in path components.
    max_name_bytes: int = 1024
    max_path_depth: int = 32
    #: The serialized ExportedProgram (``models/<name>.json``).
    max_json_bytes: int = 16 * MIB
    #: Small JSON records: ``extra/metadata.json``, AOTI ``*_metadata.json``, version markers.
    max_small_json_bytes: int = 1 * MIB
    #: Nesting depth of any JSON record.
    max_json_depth: int = 64
    #: Generated C++ scanned line by line for AOTI's constants table.
    max_source_bytes: int = 256 * MIB
    max_source_line_bytes: int = 1 * MIB
    #: Kind sniffing of non-zip inputs (tarballs, directories): bytes decompressed and members listed.
    max_sniff_bytes: int = 8 * MIB
    max_sniff_members: int = 10_000
    #: Stream every entry once to check CRC and real size (bounded memory, time proportional to size).
    verify_entries: bool = True
    #: ... stored entries included; off: only deflated ones (a stored entry's size cannot lie).
    verify_stored_entries: bool = True

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if name not in _SWITCHES and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")


_SWITCHES = frozenset({"verify_entries", "verify_stored_entries"})
DEFAULT_LIMITS = Limits()

_READ_CHUNK = 1 * MIB
_EOCD_SIGNATURE = b"PK\x05\x06"
_ZIP64_LOCATOR_SIGNATURE = b"PK\x06\x07"
_ZIP64_EOCD_SIGNATURE = b"PK\x06\x06"
_LOCAL_HEADER_SIGNATURE = b"PK\x03\x04"
_EOCD_SIZE = 22
_ZIP64_LOCATOR_SIZE = 20
_ZIP64_EOCD_MIN_SIZE = 56
_LOCAL_HEADER_SIZE = 30
_MAX_ZIP_COMMENT = 0xFFFF
_UNIX_CREATOR = 3
_MSDOS_DIRECTORY_ATTR = 0x10
_FLAG_ENCRYPTED = 0x1
_SUPPORTED_COMPRESSION = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}
_UNSAFE_NAME_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")
_DRIVE_LETTER = re.compile(r"\A[A-Za-z]:")


# --------------------------------------------------------------------------
# JSON: strict, bounded
# --------------------------------------------------------------------------


def check_json_depth(document: object, max_depth: int, what: str) -> None:
    """Raise :class:`JsonTooDeep` when ``document`` nests deeper than ``max_depth`` (iteratively: no recursion)."""
    stack: list[tuple[object, int]] = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > max_depth:
            raise JsonTooDeep(f"{what} nests deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children)


def parse_json_strict(data: bytes, *, max_depth: int, what: str) -> Any:
    """Decode UTF-8 JSON refusing NaN/Infinity literals, duplicate keys and deep nesting."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonInvalid(f"{what} is not UTF-8: {exc}") from None
    try:
        document = strict_json_loads(text)
    except RecursionError:
        raise JsonTooDeep(f"{what} nests deeper than {max_depth} levels") from None
    except ValueError as exc:
        raise JsonInvalid(f"{what} is not valid JSON: {exc}") from None
    check_json_depth(document, max_depth, what)
    return document


# --------------------------------------------------------------------------
# End of central directory: read before zipfile is allowed to parse anything
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _CentralDirectory:
    entries: int
    size: int
    offset: int


def _read_tail(fh: BinaryIO, file_size: int) -> tuple[bytes, int]:
    tail_size = min(file_size, _EOCD_SIZE + _MAX_ZIP_COMMENT + _ZIP64_LOCATOR_SIZE)
    fh.seek(file_size - tail_size)
    return fh.read(tail_size), file_size - tail_size


def _read_central_directory_bounds(fh: BinaryIO, file_size: int) -> _CentralDirectory:
    tail, tail_start = _read_tail(fh, file_size)
    position = tail.rfind(_EOCD_SIGNATURE)
    # The EOCD record is 22 bytes plus a comment that must end exactly at end of file.
    while position >= 0:
        comment_length = struct.unpack_from("<H", tail, position + 20)[0] if position + _EOCD_SIZE <= len(tail) else -1
        if position + _EOCD_SIZE + comment_length == len(tail):
            break
        position = tail.rfind(_EOCD_SIGNATURE, 0, position)
    if position < 0:
        if _EOCD_SIGNATURE in tail:
            raise ArchiveMalformed("bytes follow the end-of-central-directory record")
        raise ArchiveTruncated("no end-of-central-directory record: the zip is truncated")
    (_, disk, cd_disk, _, entries, cd_size, cd_offset, _) = struct.unpack_from("<4sHHHHIIH", tail, position)
    eocd_at = tail_start + position
    if disk != 0 or cd_disk != 0:
        raise ArchiveMalformed("multi-disk (spanned) zips are not supported")
    # A zip64 locator just before the end record means the zip64 record is
    # authoritative (torch always writes one), whatever the 32-bit fields say.
    if _has_zip64_locator(fh, eocd_at) or 0xFFFF == entries or 0xFFFFFFFF in (cd_size, cd_offset):
        entries, cd_size, cd_offset, eocd_at = _read_zip64_bounds(fh, eocd_at)
    if cd_offset + cd_size != eocd_at:
        raise ArchiveMalformed(
            "the central directory does not end where the end record starts "
            "(bytes prepended or appended to the zip, or a corrupt end record)"
        )
    return _CentralDirectory(entries=entries, size=cd_size, offset=cd_offset)


def _has_zip64_locator(fh: BinaryIO, eocd_at: int) -> bool:
    if eocd_at < _ZIP64_LOCATOR_SIZE:
        return False
    fh.seek(eocd_at - _ZIP64_LOCATOR_SIZE)
    return fh.read(4) == _ZIP64_LOCATOR_SIGNATURE


def _read_zip64_bounds(fh: BinaryIO, eocd_at: int) -> tuple[int, int, int, int]:
    if eocd_at < _ZIP64_LOCATOR_SIZE:
        raise ArchiveTruncated("zip64 end-of-central-directory locator missing")
    fh.seek(eocd_at - _ZIP64_LOCATOR_SIZE)
    locator = fh.read(_ZIP64_LOCATOR_SIZE)
    signature, _, zip64_eocd_offset, _ = struct.unpack("<4sIQI", locator)
    if signature != _ZIP64_LOCATOR_SIGNATURE:
        raise ArchiveMalformed("zip64 sizes are used but the zip64 locator is missing")
    fh.seek(zip64_eocd_offset)
    record = fh.read(_ZIP64_EOCD_MIN_SIZE)
    if len(record) < _ZIP64_EOCD_MIN_SIZE or record[:4] != _ZIP64_EOCD_SIGNATURE:
        raise ArchiveTruncated("zip64 end-of-central-directory record missing")
    (_, _, _, _, _, _, _, entries, cd_size, cd_offset) = struct.unpack("<4sQHHIIQQQQ", record)
    return entries, cd_size, cd_offset, zip64_eocd_offset


# --------------------------------------------------------------------------
# Entry vetting
# --------------------------------------------------------------------------


def _check_entry_name(name: str, is_dir: bool, limits: Limits) -> None:
    if not name.isascii():
        raise ArchivePathUnsafe(f"entry name {name!r} is not ASCII")
    if len(name.encode("ascii")) > limits.max_name_bytes:
        raise ArchivePathUnsafe(f"entry name longer than {limits.max_name_bytes} bytes: {name[:80]!r}...")
    if _UNSAFE_NAME_CHARS.search(name):
        raise ArchivePathUnsafe(f"entry name {name!r} contains a backslash or a control character")
    if name.startswith("/"):
        raise ArchivePathUnsafe(f"entry name {name!r} is an absolute path")
    if _DRIVE_LETTER.match(name):
        raise ArchivePathUnsafe(f"entry name {name!r} starts with a drive letter")
    components = name.split("/")
    if is_dir and components[-1] == "":
        components = components[:-1]
    if len(components) > limits.max_path_depth:
        raise ArchivePathUnsafe(f"entry name {name!r} is deeper than {limits.max_path_depth} components")
    for component in components:
        if component in ("", ".", ".."):
            raise ArchivePathUnsafe(f"entry name {name!r} has an empty, '.' or '..' component")


def _is_directory_entry(info: zipfile.ZipInfo) -> bool:
    return info.filename.endswith("/") or bool(info.external_attr & _MSDOS_DIRECTORY_ATTR)


def _check_entry_type(info: zipfile.ZipInfo) -> None:
    if info.create_system != _UNIX_CREATOR:
        return  # only unix creators store a file mode; MS-DOS attributes cannot express links
    mode = info.external_attr >> 16
    file_type = stat.S_IFMT(mode)
    if file_type == stat.S_IFLNK:
        raise ArchiveSymlink(f"entry {info.filename!r} is a symlink")
    if file_type not in (0, stat.S_IFREG, stat.S_IFDIR):
        raise ArchiveSymlink(f"entry {info.filename!r} is not a regular file (mode {oct(mode)})")


def _check_entry_sizes(info: zipfile.ZipInfo, limits: Limits) -> None:
    if info.flag_bits & _FLAG_ENCRYPTED:
        raise ArchiveEncrypted(f"entry {info.filename!r} is encrypted")
    if info.compress_type not in _SUPPORTED_COMPRESSION:
        raise ArchiveMalformed(f"entry {info.filename!r} uses unsupported compression method {info.compress_type}")
    if info.file_size > limits.max_entry_bytes:
        raise ArchiveTooLarge(
            f"entry {info.filename!r} expands to {info.file_size} bytes (limit {limits.max_entry_bytes})"
        )
    if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
        raise ArchiveMalformed(f"stored entry {info.filename!r} declares different stored and real sizes")
    if info.compress_type == zipfile.ZIP_DEFLATED:
        _check_ratio(info.filename, info.file_size, info.compress_size, limits)


def _check_ratio(name: str, expanded: int, compressed: int, limits: Limits) -> None:
    if expanded > limits.compression_ratio_floor_bytes and expanded > limits.max_compression_ratio * max(compressed, 1):
        raise ArchiveBomb(
            f"entry {name!r} expands {compressed} bytes into {expanded} "
            f"(ratio above {limits.max_compression_ratio}): a compression bomb"
        )


# --------------------------------------------------------------------------
# SafeZip
# --------------------------------------------------------------------------


class SafeZip:
    """A vetted, read-only view of a zip file. Use as a context manager.

    Names are full entry names (``<root>/...``). Directory entries are vetted
    but not listed in :attr:`names`.
    """

    def __init__(self, path: str | os.PathLike[str] | BinaryIO, limits: Limits = DEFAULT_LIMITS) -> None:
        """``path``: a file's path, or a seekable binary file object (left open: the caller's)."""
        self.limits = limits
        self._owned = isinstance(path, (str, os.PathLike))
        if self._owned:
            self.path = os.fspath(path)
            self._fh: BinaryIO = open(self.path, "rb")  # noqa: SIM115 - closed by close()/__exit__
        else:
            self.path = str(getattr(path, "name", "<stream>"))
            self._fh = path
        try:
            self._open()
        except BaseException:
            self._close_file()
            raise

    # -- lifecycle --------------------------------------------------------------------

    def __enter__(self) -> SafeZip:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if hasattr(self, "_zip"):  # absent when opening failed before zipfile parsed the directory
            self._zip.close()
        self._close_file()

    def _close_file(self) -> None:
        if self._owned:
            self._fh.close()

    # -- opening ----------------------------------------------------------------------

    def _open(self) -> None:
        file_size = self._fh.seek(0, os.SEEK_END)
        if file_size > self.limits.max_archive_bytes:
            raise ArchiveTooLarge(f"archive is {file_size} bytes (limit {self.limits.max_archive_bytes})")
        bounds = _read_central_directory_bounds(self._fh, file_size)
        if bounds.entries > self.limits.max_entries:
            raise ArchiveTooLarge(f"archive declares {bounds.entries} entries (limit {self.limits.max_entries})")
        if bounds.size > self.limits.max_central_directory_bytes:
            raise ArchiveTooLarge(
                f"central directory is {bounds.size} bytes (limit {self.limits.max_central_directory_bytes})"
            )
        self._central_directory = bounds
        self._fh.seek(0)
        try:
            self._zip = zipfile.ZipFile(self._fh)
        except (zipfile.BadZipFile, EOFError, ValueError, struct.error, OSError) as exc:
            raise ArchiveMalformed(f"not a readable zip: {exc}") from None
        infos = self._zip.infolist()
        if len(infos) != bounds.entries:
            raise ArchiveMalformed(
                f"the end record declares {bounds.entries} entries but the central directory holds {len(infos)}"
            )
        self._infos = self._vet_entries(infos)
        self._check_local_headers(infos)
        if self.limits.verify_entries:
            for info in self._infos.values():
                if self.limits.verify_stored_entries or info.compress_type != zipfile.ZIP_STORED:
                    self._drain(info)

    def _vet_entries(self, infos: list[zipfile.ZipInfo]) -> dict[str, zipfile.ZipInfo]:
        files: dict[str, zipfile.ZipInfo] = {}
        seen: set[str] = set()
        total = 0
        for info in infos:
            is_dir = _is_directory_entry(info)
            _check_entry_name(info.filename, is_dir, self.limits)
            if info.filename in seen:
                raise ArchiveDuplicateEntry(f"entry {info.filename!r} appears more than once")
            seen.add(info.filename)
            _check_entry_type(info)
            _check_entry_sizes(info, self.limits)
            total += info.file_size
            if total > self.limits.max_total_bytes:
                raise ArchiveTooLarge(f"entries expand to more than {self.limits.max_total_bytes} bytes in total")
            if is_dir:
                if info.file_size:
                    raise ArchiveMalformed(f"directory entry {info.filename!r} has data")
                continue
            files[info.filename] = info
        return files

    def _check_local_headers(self, infos: list[zipfile.ZipInfo]) -> None:
        """Every local header names its entry, and no two entries' bytes overlap."""
        spans: list[tuple[int, int, str]] = []
        for info in infos:
            self._fh.seek(info.header_offset)
            header = self._fh.read(_LOCAL_HEADER_SIZE)
            if len(header) < _LOCAL_HEADER_SIZE or header[:4] != _LOCAL_HEADER_SIGNATURE:
                raise ArchiveTruncated(f"entry {info.filename!r} has no local header where the directory says")
            name_length, extra_length = struct.unpack_from("<HH", header, 26)
            local_name = self._fh.read(name_length)
            if local_name != info.orig_filename.encode("ascii", "replace"):
                raise ArchiveMalformed(
                    f"entry {info.filename!r} is named {local_name[:80]!r} in its local header: "
                    "two readers would see two different archives"
                )
            data_start = info.header_offset + _LOCAL_HEADER_SIZE + name_length + extra_length
            data_end = data_start + info.compress_size
            if data_end > self._central_directory.offset:
                raise ArchiveOverlappingEntries(f"entry {info.filename!r} runs into the central directory")
            spans.append((info.header_offset, data_end, info.filename))
        spans.sort()
        # Sorted by where each entry starts, every entry must start after the
        # previous one's data ends (a data descriptor, if any, sits in between).
        for (_, end, name), (next_start, _, next_name) in pairwise(spans):
            if next_start < end:
                raise ArchiveOverlappingEntries(f"entries {name!r} and {next_name!r} share bytes")

    # -- reading ----------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """Every file entry (directories excluded), in central-directory order."""
        return list(self._infos)

    def info(self, name: str) -> zipfile.ZipInfo:
        return self._infos[name]

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def size(self, name: str) -> int:
        """Declared uncompressed size of ``name`` (already vetted against the limits)."""
        return self._infos[name].file_size

    def _stream(self, info: zipfile.ZipInfo) -> Iterator[bytes]:
        """Yield an entry's bytes in bounded chunks, enforcing its declared size and ratio while reading."""
        produced = 0
        try:
            with self._zip.open(info) as stream:
                while chunk := stream.read(_READ_CHUNK):
                    produced += len(chunk)
                    if produced > info.file_size:
                        raise ArchiveMalformed(f"entry {info.filename!r} is longer than its declared size")
                    if info.compress_type == zipfile.ZIP_DEFLATED:
                        _check_ratio(info.filename, produced, info.compress_size, self.limits)
                    yield chunk
        except zipfile.BadZipFile as exc:
            raise ArchiveMalformed(f"entry {info.filename!r} is corrupt: {exc}") from None
        except (EOFError, zlib.error) as exc:
            raise ArchiveTruncated(f"entry {info.filename!r} ends early or does not inflate: {exc}") from None
        if produced != info.file_size:
            raise ArchiveTruncated(f"entry {info.filename!r} holds {produced} bytes, declared {info.file_size}")

    def _drain(self, info: zipfile.ZipInfo) -> None:
        for _ in self._stream(info):
            pass

    def read_bytes(self, name: str, max_bytes: int, *, what: str | None = None) -> bytes:
        """The whole of a small record; :class:`ArchiveTooLarge` if it is declared larger than ``max_bytes``."""
        info = self._infos[name]
        if info.file_size > max_bytes:
            raise ArchiveTooLarge(f"{what or name} is {info.file_size} bytes (limit {max_bytes})")
        buffer = io.BytesIO()
        for chunk in self._stream(info):
            buffer.write(chunk)
        return buffer.getvalue()

    def read_head(self, name: str, size: int) -> bytes:
        """The first ``size`` bytes of an entry (for magic-number sniffing), without reading the rest."""
        info = self._infos[name]
        try:
            with self._zip.open(info) as stream:
                return stream.read(min(size, info.file_size))
        except (zipfile.BadZipFile, EOFError, zlib.error) as exc:
            raise ArchiveMalformed(f"entry {name!r} is corrupt: {exc}") from None

    def read_json(self, name: str, max_bytes: int, *, what: str | None = None) -> Any:
        """Parse a JSON record strictly; the size cap applies before a byte is read."""
        label = what or name
        info = self._infos[name]
        if info.file_size > max_bytes:
            raise JsonTooLarge(f"{label} is {info.file_size} bytes (limit {max_bytes}); refused without parsing it")
        data = self.read_bytes(name, max_bytes, what=label)
        return parse_json_strict(data, max_depth=self.limits.max_json_depth, what=label)

    def iter_lines(self, name: str, max_bytes: int, max_line_bytes: int) -> Iterator[bytes]:
        """Yield a text record's lines (without newline), streaming; over-long lines are skipped, not buffered."""
        info = self._infos[name]
        if info.file_size > max_bytes:
            raise ArchiveTooLarge(f"{name} is {info.file_size} bytes (limit {max_bytes})")
        pending = b""
        skipping = False
        for chunk in self._stream(info):
            pieces = (pending + chunk).split(b"\n")
            pending = pieces.pop()
            for piece in pieces:
                if not skipping:
                    yield piece
                skipping = False
            if len(pending) > max_line_bytes:
                # A line this long is not a constants-table line; drop it without holding it.
                pending, skipping = b"", True
        if pending and not skipping:
            yield pending
