"""The client's error hierarchy. Every refusal of the contract layer is a ``CgstoreError``."""

from __future__ import annotations


class CgstoreError(Exception):
    """Base of every error raised by cgstore_client."""


class ConfigError(CgstoreError, ValueError):
    """The client's configuration is unusable (an unreadable token file, a setting out of range...)."""


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


class StoreError(CgstoreError):
    """The store refused a request, or could not be reached.

    ``status`` and ``code`` carry the HTTP status and the protocol error code
    (docs/protocol.md) when the server answered, ``detail`` its ``detail`` object;
    ``retryable`` says whether the same request later can succeed.
    :func:`cgstore_client.worker.http.raise_for_status` is the one place an answer
    becomes one of these.
    """

    retryable = False

    def __init__(
        self, message: str, *, status: int | None = None, code: str | None = None, detail: dict | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.detail = detail or {}


class Unauthorized(StoreError):
    """401: no token, or a malformed, expired, revoked or wrongly signed one (``TOKEN_INVALID``)."""


class Denied(StoreError):
    """403: a valid token without the right (``DENIED``, or ``ROOT_RESERVED`` at the root gate)."""


class NotFound(StoreError):
    """404: absent, or not readable by this token (the store answers both alike)."""


class Conflict(StoreError):
    """409: the key already holds other bytes (``KEY_CONFLICT``; ``detail`` names both digests)."""


class Refused(StoreError):
    """Any other 4xx: the request itself is wrong (bad digest, size, key, archive, envelope...)."""


class Unavailable(StoreError):
    """The store is unreachable, overloaded (429) or in an outage (503): try again later.

    ``retry_after_s`` is the server's ``Retry-After`` when it sent one.
    """

    retryable = True

    def __init__(self, message: str, *, retry_after_s: float | None = None, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(Unavailable):
    """The store (or a blob server) was too slow: an API call past the client's deadline
    (``CGSTORE_CALL_DEADLINE_S``), or a download below its minimum throughput (``CGSTORE_MIN_BYTES_PER_S``).

    Retryable later, never within the call: the time it was given is spent.
    """


class Offline(CgstoreError):
    """The client is in offline mode and what was asked is not in the local cache."""


class IntegrityError(CgstoreError):
    """Bytes or a record that are not what was asked for (digest, size, receipt); nothing was kept."""


class TooLarge(IntegrityError):
    """An answer or a blob past the bound the client holds it to (``CGSTORE_MAX_ANSWER_BYTES``, the size the
    record states, or ``CGSTORE_MAX_BLOB_BYTES``): reading stopped at the bound and nothing was kept."""


class InsufficientSpace(CgstoreError, OSError):
    """The cache's file system has not enough free space for a download; nothing was downloaded."""


class CompiledRequired(CgstoreError):
    """A mandatory want that cannot be served compiled: fail the boot before any GPU work, retry later.

    ``reasons`` maps each such key to why (a miss, offline and not cached, a receipt refused...).
    ``retry_after`` is, when known, the seconds until it is worth asking again (a fleet's mint of the
    declaration is expected to end, or its backoff to lapse, by then).
    """

    retryable = True

    def __init__(self, reasons: dict[str, str], *, retry_after: float | None = None) -> None:
        listed = "; ".join(f"{key}: {why}" for key, why in reasons.items())
        super().__init__(f"compiled execution is mandatory and not available: {listed}")
        self.reasons = dict(reasons)
        self.retry_after = retry_after


class MintError(CgstoreError):
    """A mint that cannot produce an admissible, reproducible archive; a failed archive is never left behind."""
