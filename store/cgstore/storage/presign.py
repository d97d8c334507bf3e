"""Presigning many S3 GET URLs at once: botocore signs the first, the rest are signed by hand.

A booting worker's resolve answers up to 256 hits, each with an artifact and
components: botocore's ``generate_presigned_url`` costs about 0.6 ms a URL on
this machine (its event machinery, not the crypto), which would dominate the
resolve. ``presign_many`` asks botocore for the first URL, re-derives that
URL's SigV4 query signature by hand, and only when the two agree (same
credentials, region, addressing style, signed headers) signs the other keys
the same way: a canonical request, a string to sign, four HMACs. When they
do not agree (a signing configuration this code does not know), every URL
comes from botocore: slower, never wrong. ``BatchPresigner`` (one per S3
storage) keeps a checked signer for a second, so most batches ask botocore
for nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import threading
import time
from collections.abc import Callable, Sequence
from urllib.parse import parse_qsl, quote, urlsplit

_ALGORITHM = "AWS4-HMAC-SHA256"
_UNSIGNED = "UNSIGNED-PAYLOAD"
_SIGNATURE = "X-Amz-Signature"
_UNRESERVED_KEY = re.compile(r"[A-Za-z0-9/_.~-]*")


#: How long one botocore-checked signer is reused: URLs it signs carry its
#: X-Amz-Date, so they stay valid for at least ``ttl_s`` minus this.
SIGNER_REUSE_S = 1.0


def presign_many(client, credentials, bucket: str, keys: Sequence[str], ttl_s: int) -> list[str]:
    """GET URLs for ``keys`` (in order), valid ``ttl_s`` seconds, signed with ``credentials``."""
    return BatchPresigner(client, credentials, bucket).urls(keys, ttl_s)


class BatchPresigner:
    """``presign_many`` for one client and bucket, reusing its checked signer for ``SIGNER_REUSE_S``.

    botocore's one URL per batch (the check of the hand signing) was half a
    resolve's presigning cost; within a second every batch signs with the same
    X-Amz-Date anyway, so one check a second is enough.
    """

    def __init__(self, client, credentials, bucket: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._credentials = credentials
        self._bucket = bucket
        self._clock = clock
        self._lock = threading.Lock()
        self._signers: dict[int, tuple[float, _TemplateSigner]] = {}

    def urls(self, keys: Sequence[str], ttl_s: int) -> list[str]:
        if not keys:
            return []
        with self._lock:
            cached = self._signers.get(ttl_s)
        if cached is not None and self._clock() - cached[0] < SIGNER_REUSE_S:
            return [cached[1].url(key) for key in keys]
        checked_at = self._clock()
        template = self._botocore_url(keys[0], ttl_s)
        signer = _TemplateSigner.from_url(template, keys[0], self._credentials)
        if signer is None:
            return [template, *(self._botocore_url(key, ttl_s) for key in keys[1:])]
        with self._lock:
            self._signers[ttl_s] = (checked_at, signer)
        return [template, *(signer.url(key) for key in keys[1:])]

    def _botocore_url(self, key: str, ttl_s: int) -> str:
        return self._client.generate_presigned_url(
            "get_object", Params={"Bucket": self._bucket, "Key": key}, ExpiresIn=ttl_s
        )


class _TemplateSigner:
    """Signs other keys exactly the way one botocore URL was signed."""

    def __init__(self, parts, path_prefix: str, query: list[tuple[str, str]], signing_key: bytes, scope: str) -> None:
        self._origin = f"{parts.scheme}://{parts.netloc}"
        self._path_prefix = path_prefix
        # Everything but the path is the same for every key: canonicalized once.
        self._canonical_query = _canonical_query(query)
        self._headers_and_payload = f"host:{parts.netloc}\n\nhost\n{_UNSIGNED}"
        self._signing_key = signing_key
        self._sign_prefix = f"{_ALGORITHM}\n{dict(query)['X-Amz-Date']}\n{scope}\n"

    @classmethod
    def from_url(cls, url: str, key: str, credentials) -> _TemplateSigner | None:
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
        fields = dict(query)
        encoded_key = _quote_key(key)
        if (
            credentials is None
            or fields.get("X-Amz-Algorithm") != _ALGORITHM
            or fields.get("X-Amz-SignedHeaders") != "host"
            or not parts.path.endswith(encoded_key)
            or _SIGNATURE not in fields
        ):
            return None
        frozen = credentials.get_frozen_credentials()
        _, _, scope = fields.get("X-Amz-Credential", "").partition("/")
        date, region, service, terminator = (scope.split("/") + ["", "", "", ""])[:4]
        if terminator != "aws4_request" or frozen.access_key != fields["X-Amz-Credential"].split("/")[0]:
            return None
        signing_key = _signing_key(frozen.secret_key, date, region, service)
        unsigned = [(name, value) for name, value in query if name != _SIGNATURE]
        signer = cls(parts, parts.path[: len(parts.path) - len(encoded_key)], unsigned, signing_key, scope)
        # Trust the hand signing only when it reproduces botocore's own signature.
        return signer if hmac.compare_digest(signer._signature(parts.path), fields[_SIGNATURE]) else None

    def url(self, key: str) -> str:
        path = self._path_prefix + _quote_key(key)
        return f"{self._origin}{path}?{self._canonical_query}&{_SIGNATURE}={self._signature(path)}"

    def _signature(self, path: str) -> str:
        canonical_request = f"GET\n{path}\n{self._canonical_query}\n{self._headers_and_payload}"
        to_sign = self._sign_prefix + hashlib.sha256(canonical_request.encode()).hexdigest()
        return hmac.digest(self._signing_key, to_sign.encode(), "sha256").hex()


def _quote_key(key: str) -> str:
    # Blob keys are hex and slashes: nothing to escape, and quote() is the slow part of signing.
    return key if _UNRESERVED_KEY.fullmatch(key) else quote(key, safe="/~")


def _canonical_query(query: list[tuple[str, str]]) -> str:
    return "&".join(f"{quote(name, safe='-_.~')}={quote(value, safe='-_.~')}" for name, value in sorted(query))


def _signing_key(secret: str, date: str, region: str, service: str) -> bytes:
    key = ("AWS4" + secret).encode()
    for part in (date, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key
