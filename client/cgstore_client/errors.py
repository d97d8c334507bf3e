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
