"""Why an archive is refused: one exception class per reason, each carrying its protocol code.

Every refusal of :func:`cgstore_client.archive.inspect` is an
:class:`ArchiveError`. The class says *why* (a test or a log line can tell a
zip bomb from a path traversal without parsing messages); the ``code`` class
attribute says how the store answers it (docs/protocol.md): ``KIND_RETIRED``,
``KIND_UNSUPPORTED``, ``ARTIFACT_INVALID``, ``METADATA_INVALID`` or
``SM_MISMATCH``. The store maps ``error.code`` to its response and never
needs to know the subclass.
"""

from __future__ import annotations

from cgstore_client.errors import CgstoreError, MetadataError

__all__ = [
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
    "ArchiveSymlink",
    "ArchiveTooLarge",
    "ArchiveTruncated",
    "ArchiveUnsafe",
    "DeviceFactsInvalid",
    "JsonInvalid",
    "JsonTooDeep",
    "JsonTooLarge",
    "KindRetired",
    "KindUnsupported",
    "MetadataInvalid",
    "MetadataMissing",
    "ProgramInvalid",
    "SmMismatch",
]


class ArchiveError(CgstoreError):
    """An archive refused by the static reader. ``code`` is the protocol error code."""

    code = "ARTIFACT_INVALID"


# --- kind: what the artifact is, before what is wrong with it ---------------------------


class KindRetired(ArchiveError):
    """The retired ``torch-inductor-cache`` artifact (a cache tarball or cache directory), refused by name."""

    code = "KIND_RETIRED"


class KindUnsupported(ArchiveError):
    """Not a compiled graph at all: not a ``.pt2`` zip, and not a kind this store has ever accepted."""

    code = "KIND_UNSUPPORTED"


# --- structure -------------------------------------------------------------------------


class ArchiveMalformed(ArchiveError):
    """The bytes do not form a well-formed ``.pt2``: a broken zip, a bad CRC, a missing or unknown record."""


class ArchiveTruncated(ArchiveMalformed):
    """The zip ends early: no end-of-central-directory record, or an entry shorter than declared."""


class ArchiveLayoutInvalid(ArchiveMalformed):
    """The entries do not follow the ``.pt2`` layout (one root folder, AOTI files, one serialized program)."""


class JsonInvalid(ArchiveMalformed):
    """A JSON record that does not parse strictly (bad UTF-8, NaN, duplicate keys)."""


class JsonTooDeep(JsonInvalid):
    """A JSON record nested deeper than ``Limits.max_json_depth``."""


class ProgramInvalid(ArchiveMalformed):
    """The serialized ExportedProgram does not follow torch's export schema where the reader depends on it."""


class DeviceFactsInvalid(ArchiveMalformed):
    """AOTI device metadata that is missing, inconsistent between files, or names no known architecture."""


# --- size ------------------------------------------------------------------------------


class ArchiveTooLarge(ArchiveError):
    """An entry count, entry size, total size or central directory beyond ``Limits``."""


class ArchiveBomb(ArchiveTooLarge):
    """A compressed entry whose expansion ratio exceeds ``Limits.max_compression_ratio``."""


class JsonTooLarge(ArchiveTooLarge):
    """A JSON record larger than its limit; refused before a byte of it is parsed."""


# --- path and entry safety ----------------------------------------------------------------


class ArchiveUnsafe(ArchiveError):
    """An entry that could escape, alias or hide something when the archive is unpacked."""


class ArchivePathUnsafe(ArchiveUnsafe):
    """An absolute path, a ``..`` or ``.`` component, a backslash, a drive letter or a control character."""


class ArchiveSymlink(ArchiveUnsafe):
    """An entry whose external attributes make it a symlink (or any other non-regular file)."""


class ArchiveDuplicateEntry(ArchiveUnsafe):
    """Two entries with one name: which one a reader sees would depend on the reader."""


class ArchiveOverlappingEntries(ArchiveUnsafe):
    """Two entries whose data share bytes (the overlapping-file zip bomb)."""


class ArchiveEncrypted(ArchiveUnsafe):
    """An encrypted entry: it cannot be read statically, so it cannot be admitted."""


# --- admissibility ---------------------------------------------------------------------------


class ArchiveNotWeightFree(ArchiveError):
    """The archive carries tensor payloads (``data/weights``, ``data/constants``, weight blobs, constants in the .so)."""


class ArchiveNotPickleFree(ArchiveError):
    """The archive carries pickles (``data/sample_inputs`` or any pickle stream): compiled artifacts are code."""


class MetadataInvalid(ArchiveError):
    """``extra/metadata.json`` breaks the compiled-graph metadata schema.

    ``metadata_error`` is the :class:`~cgstore_client.errors.MetadataError`
    the schema raised (``None`` when the record is missing or unreadable).
    """

    code = "METADATA_INVALID"

    def __init__(self, message: str, metadata_error: MetadataError | None = None) -> None:
        super().__init__(message)
        self.metadata_error = metadata_error


class MetadataMissing(MetadataInvalid):
    """The archive has no ``extra/metadata.json``."""


class SmMismatch(ArchiveError):
    """The metadata's ``sm`` contradicts the device facts AOTI recorded when it compiled the archive."""

    code = "SM_MISMATCH"
