"""The static ``.pt2`` reader: what a compiled-graph archive is, measured without running it.

Public API::

    inspect(path, *, limits=DEFAULT_LIMITS) -> ArchiveReport
    inspect_zip(seekable_binary_file, *, limits=DEFAULT_LIMITS) -> ArchiveReport   # no kind sniffing
    graph_digest_from_archive(path, *, limits=DEFAULT_LIMITS) -> "blake3:<hex>"
    graph_digest_from_document(program_json_document) -> "blake3:<hex>"
    graph_digest_from_program(exported_program) -> "blake3:<hex>"      # imports torch lazily
    program_facts(program_json_document, aoti_constants=None) -> ProgramFacts
    Limits, DEFAULT_LIMITS                                              # every bound, configurable
    ArchiveReport, DeviceFacts, sm_for_device
    ArchiveError and its subclasses, each with a protocol ``code``

Module map: ``zipsafe`` (vetted zip access and bounded JSON), ``kind``
(magic-byte sniffing, the retired inductor-cache kind), ``graph`` (the graph
digest projection), ``contract`` (input contract and tensor-binding table),
``device`` (AOTI device facts and ``sm``), ``reader`` (``inspect``),
``errors``.

This package never imports torch at import time (the store imports it), never
imports or loads an archive's shared object, and never unpickles anything.
"""

from cgstore_client.archive.contract import BINDING_DYNAMIC, BINDING_STATIC
from cgstore_client.archive.device import DeviceFacts, sm_for_device
from cgstore_client.archive.errors import (
    ArchiveBomb,
    ArchiveDuplicateEntry,
    ArchiveEncrypted,
    ArchiveError,
    ArchiveLayoutInvalid,
    ArchiveMalformed,
    ArchiveNotPickleFree,
    ArchiveNotWeightFree,
    ArchiveOverlappingEntries,
    ArchivePathUnsafe,
    ArchiveSymlink,
    ArchiveTooLarge,
    ArchiveTruncated,
    ArchiveUnsafe,
    DeviceFactsInvalid,
    JsonInvalid,
    JsonTooDeep,
    JsonTooLarge,
    KindRetired,
    KindUnsupported,
    MetadataInvalid,
    MetadataMissing,
    ProgramInvalid,
    SmMismatch,
)
from cgstore_client.archive.graph import (
    PROJECTION_VERSION,
    ProgramView,
    graph_digest_from_document,
    graph_digest_from_program,
)
from cgstore_client.archive.reader import (
    ArchiveReport,
    ProgramFacts,
    graph_digest_from_archive,
    inspect,
    inspect_zip,
    program_facts,
)
from cgstore_client.archive.zipsafe import DEFAULT_LIMITS, Limits

__all__ = [
    "BINDING_DYNAMIC",
    "BINDING_STATIC",
    "DEFAULT_LIMITS",
    "PROJECTION_VERSION",
    "ArchiveBomb",
    "ArchiveDuplicateEntry",
    "ArchiveEncrypted",
    "ArchiveError",
    "ArchiveLayoutInvalid",
    "ArchiveMalformed",
    "ArchiveNotPickleFree",
    "ArchiveNotWeightFree",
    "ArchiveOverlappingEntries",
    "ArchivePathUnsafe",
    "ArchiveReport",
    "ArchiveSymlink",
    "ArchiveTooLarge",
    "ArchiveTruncated",
    "ArchiveUnsafe",
    "DeviceFacts",
    "DeviceFactsInvalid",
    "JsonInvalid",
    "JsonTooDeep",
    "JsonTooLarge",
    "KindRetired",
    "KindUnsupported",
    "Limits",
    "MetadataInvalid",
    "MetadataMissing",
    "ProgramInvalid",
    "ProgramFacts",
    "ProgramView",
    "SmMismatch",
    "graph_digest_from_archive",
    "graph_digest_from_document",
    "graph_digest_from_program",
    "inspect",
    "inspect_zip",
    "program_facts",
    "sm_for_device",
]
