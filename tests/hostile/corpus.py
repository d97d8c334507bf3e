"""A corpus of hostile and inadmissible archives, generated at test time (nothing large is committed).

Each :class:`HostileCase` names one attack or one inadmissible payload, the
file that carries it, and the exact :class:`ArchiveError` subclass the reader
must refuse it with. Cases that need a realistic ``.pt2`` around the attack
derive it from a real minted archive (``base``): the attack is then the only
thing wrong with the file.

Zips are written two ways: :func:`rewrite` copies a real archive through
:mod:`zipfile` with entries added, replaced or dropped, and :class:`RawZip`
writes stored entries byte by byte, for what :mod:`zipfile` refuses to
produce (overlapping entries, forged sizes, symlink and encryption bits).
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import tarfile
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from cgstore_client.archive import errors

__all__ = ["HostileCase", "RawZip", "build_corpus", "rewrite"]

MIB = 1 << 20
ROOT = "archive"


@dataclass(frozen=True)
class HostileCase:
    name: str
    path: Path
    error: type[errors.ArchiveError]
    about: str


# --------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------


def _read_entries(base: Path) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(base) as source:
        return [(info.filename, source.read(info)) for info in source.infolist()]


def rewrite(
    base: Path,
    out: Path,
    *,
    add: Iterable[tuple[str, bytes]] = (),
    replace: dict[str, bytes] | None = None,
    drop: Iterable[str] = (),
    rename_root: str | None = None,
) -> Path:
    """Copy ``base`` (stored entries) with entries dropped, replaced, added, or the root folder renamed."""
    replace = replace or {}
    dropped = set(drop)
    # zipfile warns about a duplicated name; writing one is the point of a case.
    with warnings.catch_warnings(), zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        warnings.simplefilter("ignore")
        for name, data in _read_entries(base):
            if name in dropped:
                continue
            data = replace.get(name, data)
            if rename_root is not None:
                name = rename_root + name[len(ROOT) :]
            target.writestr(name, data)
        for name, data in add:
            target.writestr(name, data)
    return out


class RawZip:
    """A minimal stored-only zip writer that writes exactly what it is told."""

    def __init__(self) -> None:
        self._body = bytearray()
        self._central: list[bytes] = []

    @staticmethod
    def _local_header(name: bytes, data: bytes, flags: int, declared_size: int) -> bytes:
        crc = zlib.crc32(data)
        return (
            struct.pack(
                "<4sHHHHHIIIHH", b"PK\x03\x04", 20, flags, 0, 0, 0x21, crc, len(data), declared_size, len(name), 0
            )
            + name
        )

    def _central_record(
        self, name: bytes, data: bytes, offset: int, *, flags: int, external_attr: int, declared_size: int
    ) -> bytes:
        crc = zlib.crc32(data)
        version_made_by = (3 << 8) | 20  # unix creator: external attributes carry a file mode
        return (
            struct.pack(
                "<4sHHHHHHIIIHHHHHII",
                b"PK\x01\x02",
                version_made_by,
                20,
                flags,
                0,
                0,
                0x21,
                crc,
                len(data),
                declared_size,
                len(name),
                0,
                0,
                0,
                0,
                external_attr,
                offset,
            )
            + name
        )

    def add(
        self, name: str, data: bytes, *, mode: int = 0o100644, flags: int = 0, declared_size: int | None = None
    ) -> None:
        encoded = name.encode("utf-8")
        size = len(data) if declared_size is None else declared_size
        offset = len(self._body)
        self._body += self._local_header(encoded, data, flags, size) + data
        self._central.append(
            self._central_record(encoded, data, offset, flags=flags, external_attr=mode << 16, declared_size=size)
        )

    def add_nested(self, outer: str, inner: str, inner_data: bytes) -> None:
        """Entry ``outer`` whose data *contains* entry ``inner`` (local header and data): two entries, shared bytes."""
        inner_encoded = inner.encode("utf-8")
        inner_local = self._local_header(inner_encoded, inner_data, 0, len(inner_data)) + inner_data
        outer_encoded = outer.encode("utf-8")
        outer_offset = len(self._body)
        header = self._local_header(outer_encoded, inner_local, 0, len(inner_local))
        inner_offset = outer_offset + len(header)
        self._body += header + inner_local
        self._central.append(
            self._central_record(
                outer_encoded,
                inner_local,
                outer_offset,
                flags=0,
                external_attr=0o100644 << 16,
                declared_size=len(inner_local),
            )
        )
        self._central.append(
            self._central_record(
                inner_encoded,
                inner_data,
                inner_offset,
                flags=0,
                external_attr=0o100644 << 16,
                declared_size=len(inner_data),
            )
        )

    def write(self, path: Path) -> Path:
        central = b"".join(self._central)
        end = struct.pack(
            "<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(self._central), len(self._central), len(central), len(self._body), 0
        )
        path.write_bytes(bytes(self._body) + central + end)
        return path


# --------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------


def _zip_bomb(out: Path) -> Path:
    """One deflated entry of 128 MiB of zeros (~130 KiB compressed), written in bounded memory."""
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as target:
        target.writestr(f"{ROOT}/archive_format", "pt2")
        with target.open(f"{ROOT}/data/aotinductor/model/bomb.so", "w") as stream:
            zeros = bytes(MIB)
            for _ in range(128):
                stream.write(zeros)
    return out


def _lying_sizes(out: Path) -> Path:
    """A deflated entry whose headers declare 1 000 bytes while 4 MiB inflate: only streaming with a cap is safe."""
    name = f"{ROOT}/data/aotinductor/model/liar.so"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        target.writestr(f"{ROOT}/archive_format", "pt2")
        target.writestr(name, bytes(4 * MIB))
    with zipfile.ZipFile(out) as source:
        header_offset = source.getinfo(name).header_offset
    data = bytearray(out.read_bytes())
    struct.pack_into("<I", data, header_offset + 22, 1000)  # local header: uncompressed size
    central = data.rfind(b"PK\x01\x02", 0, len(data))
    while central >= 0:
        name_length = struct.unpack_from("<H", data, central + 28)[0]
        if data[central + 46 : central + 46 + name_length] == name.encode():
            struct.pack_into("<I", data, central + 24, 1000)  # central record: uncompressed size
            break
        central = data.rfind(b"PK\x01\x02", 0, central)
    return _write(out, bytes(data))


def _many_entries(out: Path, count: int) -> Path:
    raw = RawZip()
    for index in range(count):
        raw.add(f"{ROOT}/extra/{index}", b"")
    return raw.write(out)


def _json_of_size(size: int) -> Iterable[bytes]:
    """A syntactically valid JSON document of about ``size`` bytes, in chunks (never held whole)."""
    chunk = b'"' + b"x" * (MIB - 4) + b'",'
    yield b'{"graph_module": ['
    for _ in range(size // len(chunk)):
        yield chunk
    yield b'""]}'


def _with_big_program(base: Path, out: Path, size: int) -> Path:
    program = f"{ROOT}/models/model.json"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for name, data in _read_entries(base):
            if name == program:
                with target.open(name, "w", force_zip64=True) as stream:
                    for piece in _json_of_size(size):
                        stream.write(piece)
            else:
                target.writestr(name, data)
    return out


def _tarball(out: Path, members: dict[str, bytes], *, compress: bool) -> Path:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            archive.addfile(info, io.BytesIO(data))
    payload = buffer.getvalue()
    out.write_bytes(gzip.compress(payload, mtime=0) if compress else payload)
    return out


_INDUCTOR_CACHE = {
    "inductor/fxgraph/ab/fabcdef0123/0": b"\x80\x04N.",
    "inductor/aotautograd/cd/acdef/entry": b"\x80\x04N.",
    "triton/0/ABCDEF0123/triton_poi_fused_add_0.cubin": b"\x7fELF",
    "triton/0/ABCDEF0123/__grp__triton_poi_fused_add_0.json": b"{}",
}


def _inductor_cache_dir(out: Path) -> Path:
    for name, data in _INDUCTOR_CACHE.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return out


def _metadata(base: Path, **changes: object) -> bytes:
    import json

    with zipfile.ZipFile(base) as source:
        document = json.loads(source.read(f"{ROOT}/extra/metadata.json"))
    document.update(changes)
    return json.dumps(document, sort_keys=True).encode()


def build_corpus(base: Path, out: Path) -> list[HostileCase]:
    """Write every hostile case under ``out``, deriving realistic ones from the real archive ``base``."""
    out.mkdir(parents=True, exist_ok=True)
    program = f"{ROOT}/models/model.json"
    metadata = f"{ROOT}/extra/metadata.json"
    pickle_bytes = pickle.dumps(({"x": [1, 2, 3]},), protocol=2)
    cases: list[tuple[str, Callable[[Path], Path], type[errors.ArchiveError], str]] = [
        ("zip-bomb.pt2", _zip_bomb, errors.ArchiveBomb, "128 MiB of zeros deflated ~1000:1"),
        ("lying-sizes.pt2", _lying_sizes, errors.ArchiveMalformed, "headers declare fewer bytes than are stored"),
        (
            "dotdot.pt2",
            lambda p: rewrite(base, p, add=[(f"{ROOT}/../evil.so", b"x")]),
            errors.ArchivePathUnsafe,
            "a '..' entry",
        ),
        (
            "absolute.pt2",
            lambda p: rewrite(base, p, add=[("/etc/cgstore-evil", b"x")]),
            errors.ArchivePathUnsafe,
            "an absolute entry",
        ),
        (
            "backslash.pt2",
            lambda p: rewrite(base, p, add=[(f"{ROOT}\\..\\evil.so", b"x")]),
            errors.ArchivePathUnsafe,
            "a backslash entry",
        ),
        (
            "duplicate.pt2",
            lambda p: rewrite(base, p, add=[(metadata, b"{}")]),
            errors.ArchiveDuplicateEntry,
            "two entries, one name",
        ),
        ("truncated.pt2", lambda p: _truncate(base, p), errors.ArchiveTruncated, "the first half of a real archive"),
        (
            "program-50mb.pt2",
            lambda p: _with_big_program(base, p, 50 * MIB),
            errors.JsonTooLarge,
            "a 50 MB serialized program",
        ),
        (
            "program-deep.pt2",
            lambda p: rewrite(base, p, replace={program: b"[" * 200_000 + b"]" * 200_000}),
            errors.JsonTooDeep,
            "JSON nested 200 000 deep",
        ),
        (
            "program-nan.pt2",
            lambda p: rewrite(base, p, replace={program: b'{"a": NaN}'}),
            errors.JsonInvalid,
            "a NaN literal",
        ),
        (
            "program-duplicate-key.pt2",
            lambda p: rewrite(base, p, replace={program: b'{"a": 1, "a": 2}'}),
            errors.JsonInvalid,
            "a duplicated JSON key",
        ),
        ("symlink.pt2", _symlink, errors.ArchiveSymlink, "an entry whose mode is a symlink"),
        ("encrypted.pt2", _encrypted, errors.ArchiveEncrypted, "an entry flagged encrypted"),
        ("overlapping.pt2", _overlapping, errors.ArchiveOverlappingEntries, "two entries sharing bytes"),
        ("too-many-entries.pt2", lambda p: _many_entries(p, 10_001), errors.ArchiveTooLarge, "10 001 entries"),
        ("prepended.pt2", lambda p: _prepended(base, p), errors.KindUnsupported, "a shell script with a zip appended"),
        (
            "appended.pt2",
            lambda p: _write(p, base.read_bytes() + b"trailing"),
            errors.ArchiveMalformed,
            "bytes after the zip",
        ),
        (
            "inductor-cache.tar.gz",
            lambda p: _tarball(p, _INDUCTOR_CACHE, compress=True),
            errors.KindRetired,
            "the retired cache tarball",
        ),
        (
            "inductor-cache-named.pt2",
            lambda p: _tarball(p, _INDUCTOR_CACHE, compress=False),
            errors.KindRetired,
            "a cache tar named .pt2",
        ),
        ("inductor-cache.zip", _cache_zip, errors.KindRetired, "a cache capture zipped"),
        ("inductor-cache-dir", _inductor_cache_dir, errors.KindRetired, "a cache directory"),
        ("random.pt2", lambda p: _write(p, os.urandom(4096)), errors.KindUnsupported, "random bytes"),
        ("empty.pt2", lambda p: _write(p, b""), errors.KindUnsupported, "an empty file"),
        (
            "plain.tar.gz",
            lambda p: _tarball(p, {"README.md": b"hello"}, compress=True),
            errors.KindUnsupported,
            "an unrelated tarball",
        ),
        ("not-pt2.zip", _plain_zip, errors.KindUnsupported, "a zip without archive_format"),
        (
            "weights.pt2",
            lambda p: rewrite(base, p, add=[(f"{ROOT}/data/weights/weight_0", bytes(64))]),
            errors.ArchiveNotWeightFree,
            "data/weights",
        ),
        (
            "constants.pt2",
            lambda p: rewrite(base, p, add=[(f"{ROOT}/data/constants/tensor_0", bytes(64))]),
            errors.ArchiveNotWeightFree,
            "data/constants",
        ),
        (
            "weights-blob.pt2",
            lambda p: rewrite(base, p, add=[(f"{ROOT}/data/aotinductor/model/x_weights.blob", bytes(64))]),
            errors.ArchiveNotWeightFree,
            "an external weights blob",
        ),
        (
            "sample-inputs.pt2",
            lambda p: rewrite(base, p, add=[(f"{ROOT}/data/sample_inputs/model.pt", pickle_bytes)]),
            errors.ArchiveNotPickleFree,
            "pickled sample inputs",
        ),
        (
            "hidden-pickle.pt2",
            lambda p: rewrite(base, p, add=[(f"{ROOT}/extra/notes.bin", pickle_bytes)]),
            errors.ArchiveNotPickleFree,
            "a pickle stream under another name",
        ),
        (
            "constants-in-so.pt2",
            lambda p: rewrite(base, p, replace={metadata: _metadata(base, package_constants_in_so=True)}),
            errors.ArchiveNotWeightFree,
            "metadata says constants are in the .so",
        ),
        (
            "two-roots.pt2",
            lambda p: rewrite(base, p, add=[("other/archive_format", b"pt2")]),
            errors.ArchiveLayoutInvalid,
            "two root folders",
        ),
        (
            "unexpected-entry.pt2",
            lambda p: rewrite(base, p, add=[(f"{ROOT}/data/mtia/blob", b"x")]),
            errors.ArchiveLayoutInvalid,
            "an entry outside the layout",
        ),
        (
            "no-program.pt2",
            lambda p: rewrite(base, p, drop=[program]),
            errors.ArchiveLayoutInvalid,
            "no serialized program",
        ),
        (
            "unknown-version.pt2",
            lambda p: rewrite(base, p, replace={f"{ROOT}/archive_version": b"99"}),
            errors.ArchiveMalformed,
            "archive_version 99",
        ),
        (
            "no-metadata.pt2",
            lambda p: rewrite(base, p, drop=[metadata]),
            errors.MetadataMissing,
            "no extra/metadata.json",
        ),
        (
            "bad-metadata.pt2",
            lambda p: rewrite(base, p, replace={metadata: _metadata(base, built_at="2024-01-01T00:00:00Z")}),
            errors.MetadataInvalid,
            "a wall clock in metadata",
        ),
        (
            "retired-kind-metadata.pt2",
            lambda p: rewrite(base, p, replace={metadata: _metadata(base, kind="torch-inductor-cache")}),
            errors.KindRetired,
            "metadata naming the retired kind",
        ),
        (
            "sm-mismatch.pt2",
            lambda p: rewrite(base, p, replace={metadata: _metadata(base, sm="sm_90")}),
            errors.SmMismatch,
            "metadata sm against a CPU build",
        ),
        (
            "not-a-program.pt2",
            lambda p: rewrite(base, p, replace={program: b'{"graph_module": {}}'}),
            errors.ProgramInvalid,
            "JSON that is not an ExportedProgram",
        ),
    ]
    return [HostileCase(name, build(out / name), error, about) for name, build, error, about in cases]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _truncate(base: Path, out: Path) -> Path:
    data = base.read_bytes()
    return _write(out, data[: len(data) // 2])


def _prepended(base: Path, out: Path) -> Path:
    return _write(out, b"#!/bin/sh\nexit 0\n" + base.read_bytes())


def _symlink(out: Path) -> Path:
    raw = RawZip()
    raw.add(f"{ROOT}/archive_format", b"pt2")
    raw.add(f"{ROOT}/extra/link", b"/etc/passwd", mode=0o120777)
    return raw.write(out)


def _encrypted(out: Path) -> Path:
    raw = RawZip()
    raw.add(f"{ROOT}/archive_format", b"pt2")
    raw.add(f"{ROOT}/extra/secret", b"\x00" * 32, flags=0x1)
    return raw.write(out)


def _overlapping(out: Path) -> Path:
    raw = RawZip()
    raw.add(f"{ROOT}/archive_format", b"pt2")
    raw.add_nested(f"{ROOT}/extra/outer", f"{ROOT}/extra/inner", b"shared bytes")
    return raw.write(out)


def _cache_zip(out: Path) -> Path:
    with zipfile.ZipFile(out, "w") as target:
        for name, data in _INDUCTOR_CACHE.items():
            target.writestr(name, data)
    return out


def _plain_zip(out: Path) -> Path:
    with zipfile.ZipFile(out, "w") as target:
        target.writestr("readme.txt", "not a compiled graph")
    return out
