"""The one error hierarchy of the store, and its one mapping to protocol codes.

Services raise these; they know nothing about HTTP. ``install_error_handlers``
turns every one of them (and the infrastructure failures that mean "try again")
into docs/protocol.md's ``{"error": {"code", "message", "detail"}}`` body with its
status code. Nothing else in the server builds an error response.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any, ClassVar

from sqlalchemy.orm import Session

from cgstore_client import errors as client_errors

#: Whether a miss hid an item the caller may not read at the time it was answered (the second
#: argument), asked of the database when its audit row is due.
DenialProbe = Callable[[Session, dt.datetime], bool]


class StoreError(Exception):
    """Base of every error the store answers with. Subclasses fix code and status."""

    code: ClassVar[str] = "INTERNAL"
    status: ClassVar[int] = 500
    #: A miss that answers a read the caller may not make: looks like any miss, audited as a denial.
    #: A callable instead (``maybe_hidden_miss``) decides that later, off the request path.
    hides_denial: bool | DenialProbe = False

    def __init__(self, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail

    def headers(self) -> dict[str, str]:
        return {}


class Unauthorized(StoreError):
    code, status = "UNAUTHORIZED", 401

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="cgstore"'}


class TokenInvalid(StoreError):
    code, status = "TOKEN_INVALID", 401

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="cgstore", error="invalid_token"'}


class Denied(StoreError):
    code, status = "DENIED", 403


class RootReserved(StoreError):
    code, status = "ROOT_RESERVED", 403


class NameInvalid(StoreError):
    code, status = "NAME_INVALID", 400


class NameUnknown(StoreError):
    code, status = "NAME_UNKNOWN", 404


class Conflict(StoreError):
    code, status = "CONFLICT", 409


class DigestInvalid(StoreError):
    code, status = "DIGEST_INVALID", 400


class SizeInvalid(StoreError):
    code, status = "SIZE_INVALID", 400


class BlobUnknown(StoreError):
    code, status = "BLOB_UNKNOWN", 404


class BlobUploadUnknown(StoreError):
    code, status = "BLOB_UPLOAD_UNKNOWN", 404


class RangeInvalid(StoreError):
    code, status = "RANGE_INVALID", 416

    def headers(self) -> dict[str, str]:
        # RFC 9110 §15.5.17: a 416 to a ranged read names the representation's length.
        size = self.detail.get("size")
        return {"Content-Range": f"bytes */{size}"} if isinstance(size, int) else {}


class MirrorReadOnly(StoreError):
    """A write sent to a regional mirror: it is read-only; ``detail.upstream`` names where writes go."""

    code, status = "MIRROR_READ_ONLY", 403


class BadRequest(StoreError):
    """Malformed request body or parameters that no more specific code covers."""

    code, status = "BAD_REQUEST", 400


class TooLarge(StoreError):
    code, status = "TOO_LARGE", 413


class HeadersTooLarge(TooLarge):
    """Request line and headers over ``CGSTORE_MAX_HEADER_BYTES`` (answered by the server protocol)."""

    status = 431


class RequestTimeout(StoreError):
    """The client sent nothing for too long: headers, or body bytes for ``CGSTORE_BODY_IDLE_TIMEOUT_S``."""

    code, status = "REQUEST_TIMEOUT", 408

    def headers(self) -> dict[str, str]:
        # The rest of the body will never be read: the connection cannot carry another request.
        return {"Connection": "close"}


class Unavailable(StoreError):
    """The database or the object store did not answer: retry later."""

    code, status = "UNAVAILABLE", 503
    retry_after_s: ClassVar[int] = 5

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class TooManyWaiters(Unavailable):
    """Past the process's bound on long-polls waiting at once (``CGSTORE_EVENTS_MAX_WAITERS``): retry in a moment."""

    retry_after_s: ClassVar[int] = 1


class RateLimited(StoreError):
    """Too many requests of one kind from one token: retry after ``retry_after_s``.

    The protocol has no rate-limit code; ``UNAVAILABLE`` is its "retry later",
    and the status (429, not 503) says the store itself is fine.
    """

    code, status = "UNAVAILABLE", 429

    def __init__(self, message: str, *, retry_after_s: int, **detail: Any) -> None:
        super().__init__(message, retry_after_s=retry_after_s, **detail)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class BlobReferenceUnknown(BlobUnknown):
    """A manifest names a blob this repo does not hold: the request is wrong, not the URL (400)."""

    status = 400


# -- compiled-graph admission (docs/protocol.md "Compiled graphs") ----------------------------


class KeyInvalid(StoreError):
    code, status = "KEY_INVALID", 400


class KeyMismatch(StoreError):
    code, status = "KEY_MISMATCH", 400


class KeyConflict(StoreError):
    code, status = "KEY_CONFLICT", 409


class KindRetired(StoreError):
    code, status = "KIND_RETIRED", 422


class KindUnsupported(StoreError):
    code, status = "KIND_UNSUPPORTED", 422


class EnvelopeInvalid(StoreError):
    code, status = "ENVELOPE_INVALID", 422


class ArtifactInvalid(StoreError):
    code, status = "ARTIFACT_INVALID", 422


class GraphMismatch(StoreError):
    code, status = "GRAPH_MISMATCH", 422


class ContractMismatch(StoreError):
    code, status = "CONTRACT_MISMATCH", 422


class SmMismatch(StoreError):
    code, status = "SM_MISMATCH", 422


class MetadataInvalid(StoreError):
    code, status = "METADATA_INVALID", 422


#: The codes a client-package refusal (``ArchiveError``, ``ComponentInvalid``...) may carry.
_CLIENT_CODES: dict[str, type[StoreError]] = {
    cls.code: cls
    for cls in (
        ArtifactInvalid,
        KindRetired,
        KindUnsupported,
        MetadataInvalid,
        SmMismatch,
        GraphMismatch,
        ContractMismatch,
        EnvelopeInvalid,
    )
}


#: The contract layer's value errors, which carry no protocol code of their own.
_CLIENT_CLASSES: dict[type[Exception], type[StoreError]] = {
    client_errors.KeyInvalid: KeyInvalid,
    client_errors.EnvelopeError: EnvelopeInvalid,
    client_errors.MetadataError: MetadataInvalid,
    client_errors.DigestInvalid: DigestInvalid,
}


def from_client_error(err: Exception, **detail: Any) -> StoreError:
    """The store error for a refusal of the client package's contract code.

    Archive and component refusals carry their protocol ``code``; the contract
    layer's value errors are mapped by class. Anything else is a bad request: a
    refusal of the contract layer is the input's fault, never a 500.
    """
    err_type = _CLIENT_CODES.get(getattr(err, "code", ""))
    if err_type is None:
        err_type = next((store for cls, store in _CLIENT_CLASSES.items() if isinstance(err, cls)), BadRequest)
    return err_type(str(err), reason=type(err).__name__, **detail)


def hidden_miss(err_type: type[StoreError], message: str, **detail: Any) -> StoreError:
    """A miss identical to a real one on the wire, marked so it is audited as a denial."""
    err = err_type(message, **detail)
    err.hides_denial = True
    return err


def maybe_hidden_miss(err_type: type[StoreError], message: str, probe: DenialProbe, **detail: Any) -> StoreError:
    """A miss in a private cache, where finding out whether it hides another principal's item
    would cost the request a second lookup that an absent item does not (a measurable time).
    ``probe(session, answered_at)`` answers it when the audit writes the miss's row, off the
    request path; asked of the time of the answer, so an item put there since does not count."""
    err = err_type(message, **detail)
    err.hides_denial = probe
    return err


def error_body(err: StoreError) -> dict[str, Any]:
    return {"error": {"code": err.code, "message": err.message, "detail": err.detail}}
