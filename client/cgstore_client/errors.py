"""The client's error hierarchy. Every refusal of the contract layer is a ``CgstoreError``."""

from __future__ import annotations


class CgstoreError(Exception):
    """Base of every error raised by cgstore_client."""


class KeyInvalid(CgstoreError, ValueError):
    """A ck1 key that breaks the key grammar."""


class EnvelopeError(CgstoreError, ValueError):
    """An envelope that cannot be canonicalized (e.g. missing ``text_len``)."""


class ToolchainError(CgstoreError, ValueError):
    """A toolchain that cannot be canonicalized (e.g. no ``torch`` component)."""


class MetadataError(CgstoreError, ValueError):
    """Compiled-graph metadata (``extra/metadata.json``) that breaks the schema."""


class DigestInvalid(CgstoreError, ValueError):
    """A digest that is not ``blake3:`` + 64 lowercase hex digits."""


class LaneError(CgstoreError, ValueError):
    """Kernel-lane measurements or a device size that the fit rule cannot use."""


class TransferError(CgstoreError):
    """A blob transfer that did not complete: the server refused, or the connection failed.

    ``status`` and ``code`` carry the HTTP status and protocol error code when the
    server answered; ``retryable`` says whether trying again can help.
    """

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status == 503


class DownloadCorrupt(CgstoreError):
    """Downloaded bytes whose blake3 digest or size differ from what was asked for; nothing was kept."""
