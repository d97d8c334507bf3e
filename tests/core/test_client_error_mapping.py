"""The one mapping turns every refusal of the client package's contract code into its protocol code."""

from __future__ import annotations

import pytest

from cgstore.core.errors import from_client_error
from cgstore_client import archive
from cgstore_client.components import ComponentInvalid
from cgstore_client.errors import DigestInvalid, EnvelopeError, KeyInvalid, MetadataError, ToolchainError


@pytest.mark.parametrize(
    "error,code,status",
    [
        (archive.KindRetired("retired"), "KIND_RETIRED", 422),
        (archive.KindUnsupported("x"), "KIND_UNSUPPORTED", 422),
        (archive.ArchiveBomb("x"), "ARTIFACT_INVALID", 422),
        (archive.ArchivePathUnsafe("x"), "ARTIFACT_INVALID", 422),
        (archive.ArchiveNotWeightFree("x"), "ARTIFACT_INVALID", 422),
        (archive.MetadataMissing("x"), "METADATA_INVALID", 422),
        (archive.SmMismatch("x"), "SM_MISMATCH", 422),
        (ComponentInvalid("x"), "ARTIFACT_INVALID", 422),
        (KeyInvalid("x"), "KEY_INVALID", 400),
        (EnvelopeError("x"), "ENVELOPE_INVALID", 422),
        (MetadataError("x"), "METADATA_INVALID", 422),
        (DigestInvalid("x"), "DIGEST_INVALID", 400),
        (ToolchainError("x"), "BAD_REQUEST", 400),
    ],
)
def test_client_refusals_map_to_protocol_codes_never_500(error, code, status):
    mapped = from_client_error(error)
    assert (mapped.code, mapped.status) == (code, status)
    assert mapped.detail["reason"] == type(error).__name__
