"""Which upstream keys a mirror trusts, and the one rule by which that set changes.

``cgstore mirror trust`` fetches the upstream's JWKS (``GET /v1/keys``) and
records it with its fingerprint (``fingerprint``: SHA-256 over the keys'
sorted RFC 7638 thumbprints), refusing it unless it matches ``--expect`` when
given: the operator compares the fingerprint with the upstream's own
``cgstore mirror fingerprint`` out of band. Every pulled record's receipt must
verify against these keys (``verify``), exactly as a worker's offline check.

Rotation: a receipt signed by a key the mirror does not trust makes it ask the
upstream for its key-set statements (``GET /v1/keys:statements``: the current
JWKS signed by each key the upstream signs with). A statement that a trusted
key signed announces the new set, which is adopted (and audited); anything
else (a JWKS listing a new key that no trusted key vouches for, a forged
statement) is refused, kept in ``mirror_state`` as ``refused_keys`` and
raised as the mirror's alarm (``/healthz``, the metric), never adopted.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from typing import Any

import jwt
from sqlalchemy.orm import Session

from cgstore.audit.service import record as audit
from cgstore.core.db import Database, utcnow
from cgstore.mirror.models import REFUSED_KEYS, TRUSTED_JWKS, MirrorState
from cgstore.tokens.ring import KEYSET_AUDIENCE, KEYSET_TYP
from cgstore_client.receipts import ReceiptInvalid, jwk_thumbprint, verify_receipt

#: The principal the mirror's own actions are audited under.
MIRROR_ACTOR = "mirror"


class TrustRefused(Exception):
    """A key set no trusted key vouches for, or a fingerprint other than the expected one."""


def fingerprint(jwks: Mapping[str, Any]) -> str:
    """``sha256:`` + hex SHA-256 of the sorted RFC 7638 thumbprints of the set's keys, comma-joined."""
    thumbprints = sorted(jwk_thumbprint(jwk) for jwk in jwks.get("keys") or [])
    return "sha256:" + hashlib.sha256(",".join(thumbprints).encode()).hexdigest()


def public_keys(jwks: Mapping[str, Any]) -> list[dict[str, str]]:
    """The Ed25519 public JWKs of a JWKS, only their public members (a private ``d`` is never kept)."""
    keys = []
    for jwk in jwks.get("keys") or []:
        if isinstance(jwk, Mapping) and jwk.get("kty") == "OKP" and jwk.get("crv") == "Ed25519":
            keys.append({name: str(jwk[name]) for name in ("kty", "crv", "x", "kid", "alg", "use") if name in jwk})
    return keys


def trusted(session: Session) -> dict[str, Any] | None:
    """The trusted upstream keys ``{"keys", "fingerprint", "url", "at"}``, or None before ``cgstore mirror trust``."""
    row = session.get(MirrorState, TRUSTED_JWKS)
    return dict(row.value) if row is not None else None


def trusted_keys(db: Database) -> list[dict[str, str]]:
    """The trusted upstream JWKs (empty before ``cgstore mirror trust``)."""
    with db.session() as session:
        found = trusted(session)
    return list(found["keys"]) if found else []


def record_trust(db: Database, url: str, jwks: Mapping[str, Any], *, expect: str | None, how: str) -> str:
    """Trust ``jwks`` as the upstream's keys (replacing any before); its fingerprint. ``expect``: refuse another."""
    keys = public_keys(jwks)
    if not keys:
        raise TrustRefused("the upstream's JWKS lists no Ed25519 key")
    found = fingerprint({"keys": keys})
    if expect is not None and expect != found:
        raise TrustRefused(f"the upstream's keys have fingerprint {found}, not the expected {expect}")
    with db.session() as session:
        _put(session, TRUSTED_JWKS, {"keys": keys, "fingerprint": found, "url": url, "at": time.time()})
        session.query(MirrorState).filter(MirrorState.name == REFUSED_KEYS).delete()
        audit(
            session,
            actor=MIRROR_ACTOR,
            jti=None,
            action="mirror.trust",
            target=url,
            repo=None,
            detail={"fingerprint": found, "kids": sorted(k.get("kid", "") for k in keys), "how": how},
        )
    return found


def refuse_keys(db: Database, url: str, jwks: Mapping[str, Any], reason: str) -> str:
    """Keep a key set the upstream served that no trusted key vouches for (never adopted); its fingerprint."""
    keys = public_keys(jwks)
    found = fingerprint({"keys": keys}) if keys else "none"
    with db.session() as session:
        _put(session, REFUSED_KEYS, {"keys": keys, "fingerprint": found, "reason": reason[:300], "at": time.time()})
        audit(
            session,
            actor=MIRROR_ACTOR,
            jti=None,
            action="mirror.keys_refused",
            target=url,
            repo=None,
            outcome="refused",
            detail={"fingerprint": found, "reason": reason[:300]},
        )
    return found


def _put(session: Session, name: str, value: dict) -> None:
    row = session.get(MirrorState, name)
    if row is None:
        session.add(MirrorState(name=name, value=value, updated_at=utcnow()))
    else:
        row.value, row.updated_at = value, utcnow()


def announced(statements: list[str], keys: list[dict[str, str]]) -> dict[str, Any] | None:
    """The key set a statement signed by one of the trusted ``keys`` announces, or None if none is."""
    for statement in statements:
        try:
            header = jwt.get_unverified_header(statement)
        except jwt.PyJWTError:
            continue
        if header.get("typ") != KEYSET_TYP or header.get("alg") != "EdDSA":
            continue
        signer = next((k for k in keys if k.get("kid") == header.get("kid")), None)
        if signer is None:
            continue
        try:
            claims = jwt.decode(
                statement,
                jwt.PyJWK(dict(signer), algorithm="EdDSA").key,
                algorithms=["EdDSA"],
                audience=KEYSET_AUDIENCE,
                options={"require": ["aud", "iat", "keys"]},
            )
        except jwt.PyJWTError:
            continue
        if isinstance(claims.get("keys"), list) and public_keys({"keys": claims["keys"]}):
            return {"keys": claims["keys"]}
    return None


def verify(receipt: str | None, record: Mapping[str, Any], keys: list[dict[str, str]]) -> dict[str, Any]:
    """The receipt's claims if the trusted ``keys`` verify it and it vouches for exactly ``record`` (the wire
    ``Record`` as JSON): key, repo, artifact, components, graph and publisher. Raises ``ReceiptInvalid``."""
    manifest = record["manifest"]
    claims = verify_receipt(
        receipt,
        {"keys": keys},
        expect_key=record["key"],
        expect_artifact=manifest["artifact"]["digest"],
        expect_components={c["name"]: c["digest"] for c in manifest.get("components") or []},
        expect_repo=record["repo"],
    )
    if claims.get("graph") != manifest["axes"]["graph"]:
        raise ReceiptInvalid("the receipt vouches for another graph than the record's")
    if claims.get("publisher") != (record.get("publisher") or {}).get("principal"):
        raise ReceiptInvalid("the receipt vouches for another publisher than the record's")
    return claims
