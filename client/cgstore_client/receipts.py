"""Receipt verification: a record is trusted only when the store's signature over it checks out.

A receipt is the store's signed statement that a key was published with a given
artifact (and components). The client verifies it against the store's public
keys (``GET /v1/keys``, a JWKS of Ed25519 keys, fetched once and kept in the
cache so offline boots verify too) before it trusts a record — a resolved one
or one read back from ``records/<key>.json``.

Verification is pluggable (``Client(receipt_verifier=...)``): a verifier is a
callable ``(entry, receipt, jwks) -> None`` that raises :class:`ReceiptInvalid`.
The default, :func:`verify_jws_receipt`, checks a compact EdDSA JWS whose
payload names the ``key`` and the ``artifact`` digest (and ``components``, when
present) of the entry: an edited digest in a cached record no longer matches
what the store signed.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping
from typing import Any

from cgstore_client.errors import CgstoreError


class ReceiptInvalid(CgstoreError):
    """A receipt that does not verify, or does not vouch for the record it came with."""


#: ``(entry, receipt, jwks)``; raises :class:`ReceiptInvalid`.
ReceiptVerifier = Callable[[Mapping[str, Any], object, Mapping[str, Any]], None]


def _b64(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _public_key(jwks: Mapping[str, Any], kid: object):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    for jwk in jwks.get("keys") or []:
        if jwk.get("kid") == kid and jwk.get("kty") == "OKP" and jwk.get("crv") == "Ed25519":
            return Ed25519PublicKey.from_public_bytes(_b64(jwk["x"]))
    raise ReceiptInvalid(f"receipt signed by unknown key {kid!r}")


def _vouched(entry: Mapping[str, Any]) -> dict[str, Any]:
    """What a receipt must vouch for: the key, the artifact digest, the components' digests by name."""
    claims: dict[str, Any] = {"key": entry.get("key"), "artifact": (entry.get("artifact") or {}).get("digest")}
    components = entry.get("components") or []
    if components:
        claims["components"] = {c["name"]: c["digest"] for c in components}
    return claims


def verify_jws_receipt(entry: Mapping[str, Any], receipt: object, jwks: Mapping[str, Any]) -> None:
    """Verify a compact EdDSA JWS receipt against ``jwks`` and that it vouches for ``entry``."""
    from cryptography.exceptions import InvalidSignature

    if not isinstance(receipt, str) or receipt.count(".") != 2:
        raise ReceiptInvalid("a receipt is a compact JWS")
    head, body, signature = receipt.split(".")
    try:
        header, payload = json.loads(_b64(head)), json.loads(_b64(body))
    except ValueError as err:
        raise ReceiptInvalid(f"unreadable receipt: {err}") from err
    if not isinstance(header, dict) or header.get("alg") != "EdDSA" or not isinstance(payload, dict):
        raise ReceiptInvalid("a receipt is an EdDSA JWS with a JSON object payload")
    try:
        _public_key(jwks, header.get("kid")).verify(_b64(signature), f"{head}.{body}".encode())
    except (InvalidSignature, ValueError) as err:
        raise ReceiptInvalid("receipt signature does not verify") from err
    signed = {name: payload.get(name) for name in _vouched(entry)}
    if signed != _vouched(entry):
        raise ReceiptInvalid(f"receipt vouches for {signed}, the record says {_vouched(entry)}")
