"""Publish receipts: the store's signed statement that a record was admitted, verified offline.

A receipt is a compact JWS (EdDSA, Ed25519) the store signs with its key ring
on every successful publish (201 or 200) and hands back with every resolve hit
and record read. Anyone holding the store's JWKS (``GET /v1/keys``, no token
needed) verifies it with PyJWT alone; nothing else of the store is involved.

Header: ``alg`` = ``EdDSA``, ``kid`` (a key of the JWKS), ``typ`` =
``cgstore-receipt+jwt``. Claims:

==============  ================================================================
``iss``         the store's issuer (its ``token_issuer`` setting)
``aud``         ``cgstore-receipt``
``iat``         publish time (the record's ``created_at``), epoch seconds
``repo``        ``owner/repo`` the record lives in
``key``         the ck1 key
``artifact``    the ``.pt2`` blob's digest
``components``  ``{name: digest}`` of the named components (``{}`` when none)
``graph``       the graph digest measured from the archive at admission
``publisher``   the principal (token ``sub``) that published it
``plt``         ``true`` only on records under a reserved owner (``root/*`` …),
                which only a platform principal's ``plt`` token can publish;
                absent otherwise
==============  ================================================================

The ``typ`` and ``aud`` keep receipts and cap-tokens apart both ways: the
store refuses a receipt presented as a bearer token (401 ``TOKEN_INVALID``),
and :func:`verify_receipt` refuses a cap-token (``typ`` ``JWT``, ``aud``
``cgstore``). A receipt has no ``exp``: it stays verifiable while its ``kid``
is in the JWKS, that is until the operator retires that key.

Trust anchors. By default a client verifies receipts against the JWKS of the
store it talks to, which proves the record is that store's, not that the store
is honest: a compromised store or a man in the middle serves its own keys. A
:class:`TrustPin` (``Client(trusted_jwks=)`` / ``CGSTORE_TRUSTED_JWKS``) names
the keys a worker trusts by their RFC 7638 thumbprint (:func:`jwk_thumbprint`);
receipts then verify only against keys of the store's JWKS the pin lists.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgstore_client.errors import CgstoreError, ConfigError

RECEIPT_TYP = "cgstore-receipt+jwt"
RECEIPT_AUDIENCE = "cgstore-receipt"
RECEIPT_ALGORITHM = "EdDSA"
#: The claim a platform record's receipt carries (``true``); see :func:`proves_root`.
RECEIPT_PLATFORM = "plt"
#: Every claim a receipt carries; a receipt missing one is refused.
RECEIPT_CLAIMS = ("iss", "aud", "iat", "repo", "key", "artifact", "components", "graph", "publisher")
# Clock skew tolerated on ``iat`` between the store and the verifier.
_LEEWAY_S = 300


class ReceiptInvalid(CgstoreError):
    """A receipt that does not verify, or does not vouch for the record it came with."""


class ReceiptKeyUnknown(ReceiptInvalid):
    """Signed by a key the JWKS at hand does not list (a key rotated in since it was fetched?)."""


#: ``(entry, receipt, jwks)`` -> the verified claims; raises :class:`ReceiptInvalid`.
#: (A verifier returning None verifies, but proves nothing for ``Want(root_only=True)``.)
ReceiptVerifier = Callable[[Mapping[str, Any], object, Mapping[str, Any]], Mapping[str, Any] | None]
#: The owner of the platform's records (the store's first reserved owner).
ROOT_OWNER = "root"


def verify_receipt(
    receipt: object,
    jwks: Mapping[str, Any] | list[Mapping[str, Any]],
    *,
    expect_key: str,
    expect_artifact: str,
    expect_components: Mapping[str, str] | None = None,
    expect_issuer: str | None = None,
    expect_repo: str | None = None,
) -> dict[str, Any]:
    """The claims of ``receipt`` if the JWKS verifies it and it vouches for exactly what is expected.

    ``expect_components`` maps component names to digests (``None`` or ``{}``:
    a record without components). ``expect_issuer`` and ``expect_repo`` are
    checked when given. Anything else raises :class:`ReceiptInvalid`.
    """
    import jwt

    header = _header(receipt)
    try:
        claims = jwt.decode(
            receipt,
            _public_key(jwks, header.get("kid")),
            algorithms=[RECEIPT_ALGORITHM],
            audience=RECEIPT_AUDIENCE,
            issuer=expect_issuer,
            leeway=_LEEWAY_S,
            options={"require": list(RECEIPT_CLAIMS), "verify_iss": expect_issuer is not None},
        )
    except jwt.InvalidSignatureError as err:
        raise ReceiptInvalid("receipt signature does not verify") from err
    except jwt.PyJWTError as err:
        raise ReceiptInvalid(f"receipt refused: {err}") from err
    # Exact, not PyJWT's "the aud list contains ours".
    if claims["aud"] != RECEIPT_AUDIENCE:
        raise ReceiptInvalid(f"receipt audience is not {RECEIPT_AUDIENCE!r}")
    expected = {"key": expect_key, "artifact": expect_artifact, "components": dict(expect_components or {})}
    if expect_repo is not None:
        expected["repo"] = expect_repo
    signed = {name: claims.get(name) for name in expected}
    if signed != expected:
        raise ReceiptInvalid(f"receipt vouches for {signed}, the record says {expected}")
    return claims


def verify_jws_receipt(entry: Mapping[str, Any], receipt: object, jwks: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`verify_receipt` for a resolved entry (``key``, ``repo``, ``artifact.digest``, ``components[]``).

    The receipt's ``repo`` must be the entry's: a tenant's receipt never vouches
    for an entry labelled ``root/models``.
    """
    repo = entry.get("repo")
    if not isinstance(repo, str):
        raise ReceiptInvalid("the entry names no repo for its receipt to vouch for")
    return verify_receipt(
        receipt,
        jwks,
        expect_key=entry.get("key"),
        expect_artifact=(entry.get("artifact") or {}).get("digest"),
        expect_components={c["name"]: c["digest"] for c in entry.get("components") or []},
        expect_repo=repo,
    )


def proves_root(claims: Mapping[str, Any] | None) -> bool:
    """Do verified receipt claims prove a platform record under ``root/``?

    The store stamps ``"plt": true`` only on records under a reserved owner,
    which only a platform principal's ``plt`` token can publish (the root gate).
    """
    if not claims or claims.get(RECEIPT_PLATFORM) is not True:
        return False
    repo = claims.get("repo")
    return isinstance(repo, str) and repo.partition("/")[0] == ROOT_OWNER


def _header(receipt: object) -> dict[str, Any]:
    """The unverified header, refused unless it is a receipt's (so a cap-token never passes for one)."""
    import jwt

    if not isinstance(receipt, str) or receipt.count(".") != 2:
        raise ReceiptInvalid("a receipt is a compact JWS")
    try:
        header = jwt.get_unverified_header(receipt)
    except jwt.PyJWTError as err:
        raise ReceiptInvalid(f"unreadable receipt: {err}") from err
    if header.get("typ") != RECEIPT_TYP:
        raise ReceiptInvalid(f"not a receipt (typ {header.get('typ')!r}, expected {RECEIPT_TYP!r})")
    if header.get("alg") != RECEIPT_ALGORITHM:
        raise ReceiptInvalid(f"receipt algorithm {header.get('alg')!r} not accepted (EdDSA only)")
    return header


def _public_key(jwks: Mapping[str, Any] | list[Mapping[str, Any]], kid: object):
    import jwt

    keys = (jwks.get("keys") or []) if isinstance(jwks, Mapping) else jwks
    for jwk in keys:
        if jwk.get("kid") == kid and jwk.get("kty") == "OKP" and jwk.get("crv") == "Ed25519":
            try:
                return jwt.PyJWK(dict(jwk), algorithm=RECEIPT_ALGORITHM).key
            except jwt.PyJWTError as err:
                raise ReceiptInvalid(f"unusable key {kid!r} in the JWKS: {err}") from err
    raise ReceiptKeyUnknown(f"receipt signed by unknown key {kid!r}")


# --- trust anchors -----------------------------------------------------------------------------

#: RFC 7638 section 3.2: the members of a public JWK its thumbprint hashes, per key type (sorted).
THUMBPRINT_MEMBERS = {
    "OKP": ("crv", "kty", "x"),
    "EC": ("crv", "kty", "x", "y"),
    "RSA": ("e", "kty", "n"),
    "oct": ("k", "kty"),
}
#: A SHA-256 thumbprint: 32 bytes in base64url without padding.
_THUMBPRINT = re.compile(r"[A-Za-z0-9_-]{43}")


def jwk_thumbprint(jwk: Mapping[str, Any]) -> str:
    """The RFC 7638 thumbprint of a JWK: SHA-256 of its required members as JSON without whitespace, in
    lexicographic order, in base64url without padding. Names a key whatever its ``kid``."""
    members = THUMBPRINT_MEMBERS.get(jwk.get("kty"))  # type: ignore[arg-type]
    if members is None or not all(isinstance(jwk.get(m), str) for m in members):
        raise ConfigError(f"not a public JWK with a thumbprint (kty {jwk.get('kty')!r})")
    canonical = json.dumps({m: jwk[m] for m in members}, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    return base64.urlsafe_b64encode(hashlib.sha256(canonical.encode()).digest()).rstrip(b"=").decode()


@dataclass(frozen=True)
class TrustPin:
    """The keys a worker trusts to sign receipts, by RFC 7638 thumbprint.

    :meth:`narrow` keeps of a store's JWKS only the keys the pin lists: a key the
    store rotates in verifies nothing until the pin lists it, and a key it retires
    stops verifying, as without a pin.
    """

    thumbprints: frozenset[str]
    #: Where the pin came from, for messages.
    source: str

    @classmethod
    def parse(cls, value: object) -> TrustPin | None:
        """A pin from a JWKS (``{"keys": [...]}``), a JWKS file's path, a comma-separated string of
        thumbprints, or an iterable of thumbprints; None stays None (no pin)."""
        if value is None or isinstance(value, TrustPin):
            return value
        if isinstance(value, Mapping):
            return cls._of_jwks(value, "the given JWKS")
        if isinstance(value, os.PathLike):
            return cls._of_file(Path(value))
        if isinstance(value, str):
            items = [item.strip() for item in value.split(",") if item.strip()]
            if items and all(_THUMBPRINT.fullmatch(item) for item in items):
                return cls._of_thumbprints(items)
            return cls._of_file(Path(value))
        if isinstance(value, Iterable):
            return cls._of_thumbprints([str(item).strip() for item in value])
        raise ConfigError(f"trusted_jwks is a JWKS, a JWKS file or thumbprints, not {type(value).__name__}")

    @classmethod
    def _of_thumbprints(cls, items: list[str]) -> TrustPin:
        bad = [item for item in items if not _THUMBPRINT.fullmatch(item)]
        if bad or not items:
            raise ConfigError(
                f"trusted key thumbprints are RFC 7638 SHA-256 thumbprints (43 base64url characters), "
                f"not {bad[:3] or items!r}"
            )
        return cls(frozenset(items), f"{len(items)} pinned thumbprint(s)")

    @classmethod
    def _of_file(cls, path: Path) -> TrustPin:
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"CGSTORE_TRUSTED_JWKS {str(path)[:200]!r} is neither thumbprints nor a readable JWKS file: {err}"
            ) from None
        if not isinstance(document, Mapping):
            raise ConfigError(f"{path} is not a JWKS (an object with 'keys')")
        return cls._of_jwks(document, str(path))

    @classmethod
    def _of_jwks(cls, jwks: Mapping[str, Any], source: str) -> TrustPin:
        keys = jwks.get("keys")
        if not isinstance(keys, list) or not keys:
            raise ConfigError(f"{source} lists no keys to trust")
        return cls(frozenset(jwk_thumbprint(jwk) for jwk in keys if isinstance(jwk, Mapping)), source)

    def narrow(self, jwks: Mapping[str, Any] | None) -> dict[str, Any]:
        """The keys of ``jwks`` this pin trusts."""
        return {"keys": [jwk for jwk in (jwks or {}).get("keys") or [] if self.trusts(jwk)]}

    def trusts(self, jwk: Mapping[str, Any]) -> bool:
        try:
            return jwk_thumbprint(jwk) in self.thumbprints
        except ConfigError:
            return False

    def __str__(self) -> str:
        return f"the trust pin ({self.source})"
