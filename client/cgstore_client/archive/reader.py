"""``inspect``: read a ``.pt2`` statically and report what it is, or refuse it with a named reason.

The order of the checks follows docs/protocol.md's admission order, so the first
refusal is the one the store would answer:

1. kind: magic bytes and names (a retired inductor-cache tarball/zip/directory
   is :class:`KindRetired`; anything else that is not a ``.pt2`` zip is
   :class:`KindUnsupported`);
2. structure and safety: :class:`~cgstore_client.archive.zipsafe.SafeZip`
   (sizes, counts, ratio, paths, symlinks, duplicates, overlap, CRC);
3. layout: one root folder (any name: the root follows the file name torch
   was given), ``archive_format`` = ``pt2``, a known ``archive_version``,
   exactly one model with both its AOTI files
   (``data/aotinductor/<model>/``, a compiled ``.so`` among them) and its
   serialized program (``models/<model>.json``), nothing else but torch's
   own bookkeeping records and ``extra/``;
4. admissibility: no ``data/weights``, ``data/constants``,
   ``xl_model_weights`` or weight blobs (:class:`ArchiveNotWeightFree`), no
   ``data/sample_inputs`` and no pickle stream anywhere
   (:class:`ArchiveNotPickleFree`);
5. the program: graph digest, input contract, binding table;
6. device facts from AOTI's metadata, and the ``sm`` they spell;
7. ``extra/metadata.json`` (:class:`MetadataMissing` / :class:`MetadataInvalid`),
   its policy (constants packaged in the .so are not weight-free) and its
   ``sm`` against the device facts (:class:`SmMismatch`).

Nothing from the archive is executed, imported or unpickled; the reader needs
no torch. It takes a filesystem path (a directory is sniffed for the retired
kind and refused); callers holding bytes write them to a file first, which
the store does anyway to hash them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from cgstore_client.archive.contract import (
    AotiConstant,
    derive_binding_table,
    derive_input_contract,
    parse_aoti_constants,
)
from cgstore_client.archive.device import DeviceFacts, device_facts_from_aoti_metadata
from cgstore_client.archive.errors import (
    ArchiveError,
    ArchiveLayoutInvalid,
    ArchiveMalformed,
    ArchiveNotPickleFree,
    ArchiveNotWeightFree,
    KindRetired,
    KindUnsupported,
    MetadataInvalid,
    MetadataMissing,
    ProgramInvalid,
    SmMismatch,
)
from cgstore_client.archive.graph import ProgramView, tied_graph_digest
from cgstore_client.archive.kind import (
    FORMAT_ZIP,
    RETIRED_KIND,
    looks_like_inductor_cache,
    refuse_non_zip,
    sniff_format,
)
from cgstore_client.archive.zipsafe import DEFAULT_LIMITS, Limits, SafeZip
from cgstore_client.errors import MetadataError
from cgstore_client.metadata import KIND_AOT_INDUCTOR, CompiledGraphMetadata, canonical_ties, parse_metadata

__all__ = [
    "ARCHIVE_FORMAT",
    "KNOWN_ARCHIVE_VERSIONS",
    "ArchiveReport",
    "ProgramFacts",
    "graph_digest_from_archive",
    "inspect",
    "inspect_zip",
    "program_facts",
]

ARCHIVE_FORMAT = "pt2"
#: ``<root>/archive_version`` values this reader understands (torch 2.13 writes "0").
KNOWN_ARCHIVE_VERSIONS = frozenset({"0"})
METADATA_PATH = "extra/metadata.json"

# Records torch's archive writer adds on its own.
_TORCH_RECORDS = frozenset(
    {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}
)
_WEIGHT_PREFIXES = ("data/weights/", "data/constants/", "xl_model_weights/")
_PICKLE_PREFIXES = ("data/sample_inputs/",)
_WEIGHT_FILE_SUFFIXES = ("_weights.blob", "_serialized_weights.bin", "weights_config.json")
_PICKLE_SUFFIXES = (".pkl", ".pickle", ".pt", ".pth")
# Pickle protocols 2-5 open with PROTO (0x80) and the protocol number.
_PICKLE_MAGIC_RE = re.compile(rb"\A\x80[\x02-\x05]")
_NAME_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_MODEL_PROGRAM_RE = re.compile(r"\Amodels/([^/]+)\.json\Z")
_AOTI_FILE_RE = re.compile(r"\Adata/aotinductor/([^/]+)/(.+)\Z")
_SMALL_RECORD_BYTES = 64


@dataclass(frozen=True)
class ArchiveReport:
    """What a static read of an admissible ``.pt2`` established.

    ``input_contract`` and ``binding_table`` are plain JSON-able documents
    (strings, ints, lists, objects): treat them as read-only.
    """

    kind: str
    format: str
    root: str
    model_name: str
    archive_version: str
    graph_digest: str
    input_contract: dict[str, Any]
    binding_table: list[dict[str, Any]]
    sm: str
    device: DeviceFacts
    metadata: CompiledGraphMetadata
    aoti_files: tuple[str, ...] = field(default=())
    total_bytes: int = 0

    def to_document(self) -> dict[str, Any]:
        """The report as one JSON-able document (what a store record keeps)."""
        return {
            "kind": self.kind,
            "format": self.format,
            "root": self.root,
            "model_name": self.model_name,
            "archive_version": self.archive_version,
            "graph_digest": self.graph_digest,
            "input_contract": self.input_contract,
            "binding_table": self.binding_table,
            "sm": self.sm,
            "device": self.device.to_document(),
            "metadata": self.metadata.to_document(),
            "aoti_files": list(self.aoti_files),
            "total_bytes": self.total_bytes,
        }


# --------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------


@dataclass
class _Layout:
    root: str
    model_name: str
    archive_version: str
    program: str
    aoti_files: list[str]

    def full(self, relative: str) -> str:
        return f"{self.root}/{relative}"


def _relative_names(zf: SafeZip) -> tuple[str, list[str]]:
    """The one root folder and every entry's name below it."""
    roots = {name.split("/", 1)[0] for name in zf.names}
    loose = [name for name in zf.names if "/" not in name]
    candidates = sorted(root for root in roots if f"{root}/archive_format" in zf)
    if not candidates:
        if looks_like_inductor_cache(zf.names):
            raise KindRetired(
                f"this zip holds an inductor/triton cache: the {RETIRED_KIND!r} kind is retired and refused; "
                f"only {KIND_AOT_INDUCTOR!r} (.pt2) compiled graphs are accepted"
            )
        raise KindUnsupported("this zip is not a .pt2 archive (no <root>/archive_format)")
    if loose or len(roots) != 1:
        raise ArchiveLayoutInvalid(f"a .pt2 has exactly one root folder; found {sorted(roots)[:8]}")
    root = candidates[0]
    if not _NAME_RE.match(root):
        raise ArchiveLayoutInvalid(f"root folder {root!r} is not a plain name")
    return root, [name[len(root) + 1 :] for name in zf.names]


def _read_marker(zf: SafeZip, name: str) -> str:
    data = zf.read_bytes(name, _SMALL_RECORD_BYTES)
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ArchiveMalformed(f"{name} is not ASCII") from None


def _refuse_payload(relative: str) -> None:
    if relative.startswith(_WEIGHT_PREFIXES):
        raise ArchiveNotWeightFree(
            f"{relative} is a tensor payload: an admissible archive is weight-free "
            "(every constant is bound by name at load)"
        )
    if relative.startswith(_PICKLE_PREFIXES):
        raise ArchiveNotPickleFree(f"{relative} holds pickled sample inputs: an admissible archive is pickle-free")
    leaf = relative.rsplit("/", 1)[-1]
    if leaf.endswith(_WEIGHT_FILE_SUFFIXES):
        raise ArchiveNotWeightFree(f"{relative} is a weights file: an admissible archive is weight-free")
    if leaf.endswith(_PICKLE_SUFFIXES):
        raise ArchiveNotPickleFree(f"{relative} is a pickle: an admissible archive is pickle-free")


def _classify(relative_names: list[str]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Programs by model and AOTI files by model; besides those, only torch's records and ``extra/`` may appear."""
    programs: dict[str, str] = {}
    aoti: dict[str, list[str]] = {}
    for relative in relative_names:
        _refuse_payload(relative)
        if relative in _TORCH_RECORDS:
            continue
        if match := _MODEL_PROGRAM_RE.match(relative):
            programs[match.group(1)] = relative
        elif match := _AOTI_FILE_RE.match(relative):
            aoti.setdefault(match.group(1), []).append(relative)
        elif not relative.startswith("extra/"):
            raise ArchiveLayoutInvalid(f"unexpected entry {relative!r} in a compiled-graph archive")
    return programs, aoti


def _single_model(programs: dict[str, str], aoti: dict[str, list[str]]) -> str:
    if not programs:
        raise ArchiveLayoutInvalid("no serialized program (models/<model>.json): the graph cannot be measured")
    if not aoti:
        raise ArchiveLayoutInvalid("no AOTInductor files (data/aotinductor/<model>/): nothing was compiled")
    if set(programs) != set(aoti):
        raise ArchiveLayoutInvalid(
            f"serialized programs {sorted(programs)} and compiled models {sorted(aoti)} do not name the same models"
        )
    if len(programs) != 1:
        raise ArchiveLayoutInvalid(f"one compiled graph per archive; found models {sorted(programs)}")
    (model_name,) = programs
    if not _NAME_RE.match(model_name):
        raise ArchiveLayoutInvalid(f"model name {model_name!r} is not a plain name")
    if not any(name.endswith(".so") for name in aoti[model_name]):
        raise ArchiveLayoutInvalid(f"data/aotinductor/{model_name}/ has no compiled shared object (.so)")
    return model_name


def _refuse_pickle_streams(zf: SafeZip) -> None:
    for name in zf.names:
        if _PICKLE_MAGIC_RE.match(zf.read_head(name, 2)):
            raise ArchiveNotPickleFree(f"{name} is a pickle stream: an admissible archive is pickle-free")


def _read_layout(zf: SafeZip) -> _Layout:
    root, relative_names = _relative_names(zf)
    if _read_marker(zf, f"{root}/archive_format") != ARCHIVE_FORMAT:
        raise KindUnsupported(f"{root}/archive_format is not {ARCHIVE_FORMAT!r}")
    if f"{root}/archive_version" not in zf:
        raise ArchiveMalformed(f"{root}/archive_version is missing")
    version = _read_marker(zf, f"{root}/archive_version")
    if version not in KNOWN_ARCHIVE_VERSIONS:
        raise ArchiveMalformed(
            f"archive_version {version!r} is not one this reader knows {sorted(KNOWN_ARCHIVE_VERSIONS)}"
        )
    programs, aoti = _classify(relative_names)
    _refuse_pickle_streams(zf)
    model_name = _single_model(programs, aoti)
    return _Layout(
        root=root,
        model_name=model_name,
        archive_version=version,
        program=programs[model_name],
        aoti_files=sorted(aoti[model_name]),
    )


# --------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ProgramFacts:
    """What the serialized program says: its graph digest, input contract and binding table."""

    graph_digest: str
    input_contract: dict[str, Any]
    binding_table: list[dict[str, Any]]


def program_facts(document: object, aoti_constants: list[AotiConstant] | None = None) -> ProgramFacts:
    """Measure a decoded program document; anything off torch's schema is :class:`ProgramInvalid`.

    The document is untrusted: a value of the wrong type deep inside it must
    end as a named refusal, never as a ``TypeError`` escaping the reader.
    """
    try:
        view = ProgramView(document)
        # Payload directories are refused before this point, so the archive carries no bytes for any constant.
        bindings = derive_binding_table(view, aoti_constants, packaged_bytes={})
        return ProgramFacts(view.digest, derive_input_contract(view), bindings)
    except ArchiveError:
        raise
    except (TypeError, KeyError, AttributeError, ValueError, IndexError) as exc:
        raise ProgramInvalid(f"serialized program does not follow the export schema: {exc!r}") from None


def _read_program(zf: SafeZip, layout: _Layout) -> object:
    return zf.read_json(layout.full(layout.program), zf.limits.max_json_bytes, what=layout.program)


def _model_dir(layout: _Layout) -> str:
    return f"data/aotinductor/{layout.model_name}/"


def _read_device(zf: SafeZip, layout: _Layout) -> DeviceFacts:
    prefix = _model_dir(layout)
    documents = {
        relative: zf.read_json(layout.full(relative), zf.limits.max_small_json_bytes, what=relative)
        for relative in layout.aoti_files
        if relative.endswith("_metadata.json") and "/" not in relative[len(prefix) :]
    }
    return device_facts_from_aoti_metadata(documents)


def _read_aoti_constants(zf: SafeZip, layout: _Layout) -> list[AotiConstant] | None:
    wrappers = [relative for relative in layout.aoti_files if relative.endswith(".wrapper.cpp")]
    if not wrappers:
        return None  # no generated wrapper shipped: the binding table comes from the signature alone
    lines = zf.iter_lines(layout.full(wrappers[0]), zf.limits.max_source_bytes, zf.limits.max_source_line_bytes)
    return parse_aoti_constants(lines)


def _read_metadata(zf: SafeZip, layout: _Layout) -> CompiledGraphMetadata:
    name = layout.full(METADATA_PATH)
    if name not in zf:
        raise MetadataMissing(f"the archive has no {METADATA_PATH}: a compiled graph states its metadata")
    try:
        document = zf.read_json(name, zf.limits.max_small_json_bytes, what=METADATA_PATH)
    except ArchiveError as exc:
        raise MetadataInvalid(f"{METADATA_PATH} is unreadable: {exc}") from exc
    kind = document.get("kind") if isinstance(document, Mapping) else None
    if kind == RETIRED_KIND:
        raise KindRetired(f"{METADATA_PATH} declares kind {RETIRED_KIND!r}: that kind is retired and refused")
    if kind is not None and kind != KIND_AOT_INDUCTOR:
        raise KindUnsupported(f"{METADATA_PATH} declares kind {kind!r}; only {KIND_AOT_INDUCTOR!r} is accepted")
    try:
        return parse_metadata(document)
    except MetadataError as exc:
        raise MetadataInvalid(f"{METADATA_PATH}: {exc}", exc) from exc


def _check_ties(metadata: CompiledGraphMetadata, binding_table: list[dict[str, Any]]) -> None:
    known = {row["fqn"] for row in binding_table}
    for group in metadata.ties:
        if unknown := [name for name in group if name not in known]:
            raise MetadataInvalid(f"{METADATA_PATH}: ties name {unknown}, which are not constants of the program")


def _check_policy(metadata: CompiledGraphMetadata, device: DeviceFacts) -> None:
    if metadata.package_constants_in_so:
        raise ArchiveNotWeightFree(
            "metadata says the constants are packaged in the .so (package_constants_in_so=true): not weight-free"
        )
    if metadata.sm != device.sm:
        raise SmMismatch(
            f"metadata says sm {metadata.sm!r} but AOTI compiled for {device.sm!r} "
            f"({device.device_key}, {device.machine}, {' '.join(device.cpu_isa) or device.compute_capability})"
        )


# --------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------


def inspect(path: str | os.PathLike[str], *, limits: Limits = DEFAULT_LIMITS) -> ArchiveReport:
    """Read the archive at ``path`` statically; return its report or raise an :class:`ArchiveError`."""
    path = os.fspath(path)
    refuse_non_zip(path, limits)
    with SafeZip(path, limits) as zf:
        return _report(zf)


def inspect_zip(stream: BinaryIO, *, limits: Limits = DEFAULT_LIMITS) -> ArchiveReport:
    """:func:`inspect` of a zip given as a seekable binary file object (the store's ranged view of a
    stored blob): only what the checks need is read. Anything that does not start like a zip is
    :class:`KindUnsupported` here; :func:`inspect` of a file names the retired kind too."""
    stream.seek(0)
    if sniff_format(stream.read(4)) != FORMAT_ZIP:  # either zip magic is 4 bytes
        raise KindUnsupported("this file does not start like a zip")
    with SafeZip(stream, limits) as zf:
        return _report(zf)


def _report(zf: SafeZip) -> ArchiveReport:
    """Every check after the kind, on an opened zip; the report."""
    layout = _read_layout(zf)
    facts = program_facts(_read_program(zf, layout), _read_aoti_constants(zf, layout))
    device = _read_device(zf, layout)
    metadata = _read_metadata(zf, layout)
    _check_policy(metadata, device)
    _check_ties(metadata, facts.binding_table)
    return ArchiveReport(
        kind=KIND_AOT_INDUCTOR,
        format=ARCHIVE_FORMAT,
        root=layout.root,
        model_name=layout.model_name,
        archive_version=layout.archive_version,
        graph_digest=tied_graph_digest(facts.graph_digest, metadata.ties),
        input_contract=facts.input_contract,
        binding_table=facts.binding_table,
        sm=device.sm,
        device=device,
        metadata=metadata,
        aoti_files=tuple(layout.aoti_files),
        total_bytes=sum(zf.size(name) for name in zf.names),
    )


def graph_digest_from_archive(path: str | os.PathLike[str], *, limits: Limits = DEFAULT_LIMITS) -> str:
    """The graph digest of the one serialized program in a ``.pt2``.

    The same structural and safety checks as :func:`inspect`, but no
    admissibility or metadata checks: the digest of any torch-written
    ``.pt2`` (weights and all) can be measured.
    """
    path = os.fspath(path)
    refuse_non_zip(path, limits)
    with SafeZip(path, limits) as zf:
        root, relative_names = _relative_names(zf)
        programs = sorted(name for name in relative_names if _MODEL_PROGRAM_RE.match(name))
        if len(programs) != 1:
            raise ArchiveLayoutInvalid(f"expected one serialized program (models/<model>.json), found {programs}")
        document = zf.read_json(f"{root}/{programs[0]}", limits.max_json_bytes, what=programs[0])
        return tied_graph_digest(program_facts(document).graph_digest, _declared_ties(zf, root))


def _declared_ties(zf: SafeZip, root: str) -> tuple[tuple[str, ...], ...]:
    """The ``ties`` of an archive's metadata, if it has metadata (a plain torch ``.pt2`` has none)."""
    name = f"{root}/{METADATA_PATH}"
    if name not in zf:
        return ()
    document = zf.read_json(name, zf.limits.max_small_json_bytes, what=METADATA_PATH)
    try:
        return canonical_ties(document.get("ties", []) if isinstance(document, Mapping) else [])
    except MetadataError as exc:
        raise MetadataInvalid(f"{METADATA_PATH}: {exc}", exc) from exc
