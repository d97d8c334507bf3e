"""How the S3 driver tells an outage from a bug: S3 answers mapped to the store's errors.

Failures
--------
Connection errors, timeouts, 5xx, throttling, and credential or bucket
misconfiguration raise ``Unavailable``; a missing object raises
``BlobUnknown`` (or ``BlobUploadUnknown`` for staging). botocore is configured
with short connect timeouts and two retries, so a dead store surfaces within
seconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from botocore.exceptions import (
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

from cgstore.core.errors import Unavailable
from cgstore.storage.hashing import READ_CHUNK_BYTES

# Answers that mean "the store cannot serve us right now" rather than a bug
# here: throttling, and misconfiguration an operator must fix (bucket, keys).
UNAVAILABLE_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "NoSuchBucket",
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "NoSuchUpload",  # our multipart upload vanished (swept or expired): retry from scratch
    }
)
MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
TRANSPORT_ERRORS = (
    BotoConnectionError,  # EndpointConnectionError, ConnectTimeoutError, proxy/SSL errors
    HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)


def error_code(exc: ClientError) -> tuple[str, int]:
    error = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(error.get("Code", "")), int(status or 0)


def is_missing(exc: ClientError) -> bool:
    code, status = error_code(exc)
    return code in MISSING_CODES or (status == 404 and code != "NoSuchBucket")


def is_unavailable(exc: ClientError) -> bool:
    code, status = error_code(exc)
    return status >= 500 or status == 403 or code in UNAVAILABLE_CODES


@contextlib.contextmanager
def s3_errors(operation: str) -> Iterator[None]:
    """Turn infrastructure failures into ``Unavailable``; let real bugs through."""
    try:
        yield
    except ClientError as exc:
        if is_unavailable(exc):
            code, status = error_code(exc)
            raise Unavailable("object storage failed", operation=operation, code=code, status=status) from exc
        raise
    except TRANSPORT_ERRORS as exc:
        # The exception's type says what failed; its text names internal endpoints (kept in the log).
        raise Unavailable("object storage unreachable", operation=operation, cause=type(exc).__name__) from exc


def ping_failure(code: str, status: int) -> str:
    """What an operator reads in ``/readyz`` when the bucket's HEAD fails (a HEAD answer has no body:
    the status is all S3 says)."""
    if status == 403 or code in {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"}:
        return f"S3 refused the store's credentials for the bucket ({status} {code}): check its AWS keys"
    if status == 404 or code == "NoSuchBucket":
        return "the bucket does not exist"
    return f"bucket not reachable ({status} {code})"


def stream_body(body) -> Iterator[bytes]:
    """Yield an object's body in bounded chunks; mid-stream failures are outages."""
    try:
        with s3_errors("read"):
            yield from body.iter_chunks(READ_CHUNK_BYTES)
    finally:
        body.close()
