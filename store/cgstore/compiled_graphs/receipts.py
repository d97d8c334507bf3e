"""Signing publish receipts: the store's statement that it admitted a record, checkable offline.

The claims, header and their meaning are the client package's
(``cgstore_client.receipts``, where they are verified): this module only signs
them, with the key ring that signs cap-tokens (``tokens/ring.py``), so one
JWKS (``GET /v1/keys``) verifies both. The ``typ`` and ``aud`` differ from a
cap-token's, and ``TokenService.verify`` refuses the receipt ``typ``: a receipt
never authenticates anyone.

A receipt is signed at publish and kept on the record row (with the ``kid``
that signed it), so a 200 re-publish and every resolve hit answer the very
bytes the 201 did. Retiring a key would leave its receipts unverifiable:
``cgstore keys retire`` re-signs them with the current key in the same
transaction (``retire``), so a worker resolving again always gets a receipt
the JWKS verifies.

Signing and retiring exclude each other: a receipt is signed in the
transaction that writes its record, after the write, with the signing key's
row read ``FOR SHARE`` (``KeyRing.signing_key``); ``retire`` writes the key's
row first. On PostgreSQL the retirement waits for every transaction signing
with the key, then re-signs what they committed; on SQLite writers are
serialized. So a receipt is never signed by a key whose retirement has
committed, and the re-signing sees every receipt the key ever signed.

Records under a reserved owner (``root/*`` …) could only be written through
the root gate (``access.root_gate``: a platform principal's ``plt`` token with
a grant naming the owner), so their receipts also carry ``"plt": true``: a
worker proves offline that a record is the platform's, not a tenant's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select
from sqlalchemy.orm import Session

from cgstore.compiled_graphs.models import CompiledGraph, CompiledGraphComponent
from cgstore.core.names import is_reserved_owner
from cgstore.repos.models import Repo
from cgstore.tokens.ring import KeyRing
from cgstore_client.receipts import (
    RECEIPT_ALGORITHM,
    RECEIPT_AUDIENCE,
    RECEIPT_PLATFORM,
    RECEIPT_TYP,
    ReceiptInvalid,
    verify_receipt,
)
from cgstore_client.wire.records import Record

# Records re-signed per query when a key retires (bounded memory, whatever the table's size).
_RESIGN_BATCH = 500


def stamp(
    session: Session,
    keys: KeyRing,
    *,
    issuer: str,
    repo: str,
    row: CompiledGraph,
    components: Iterable[tuple[str, str]],
) -> None:
    """Sign ``row`` (published in ``repo``, with its ``(name, digest)`` components) and keep receipt and kid on it.

    In the transaction that writes the row, after that write (see the module docstring).
    """
    _sign(keys.signing_key(session), issuer=issuer, repo=repo, row=row, components=components)


def retire(session: Session, keys: KeyRing, *, issuer: str, kid: str) -> tuple[bool, int]:
    """Retire ``kid`` and re-sign its receipts, in ``session``'s transaction: (newly retired?, how many re-signed).

    An already retired key is re-signed for too: that repairs receipts a store
    from before signing and retiring excluded each other signed after the retirement.
    """
    retired = keys.retire(session, kid)
    return retired, _resign(session, keys, issuer=issuer, retired_kid=kid)


def _sign(
    signer: tuple[str, Ed25519PrivateKey],
    *,
    issuer: str,
    repo: str,
    row: CompiledGraph,
    components: Iterable[tuple[str, str]],
) -> None:
    kid, private_key = signer
    claims = {
        "iss": issuer,
        "aud": RECEIPT_AUDIENCE,
        "iat": int(row.created_at.timestamp()),
        "repo": repo,
        "key": row.key,
        "artifact": row.artifact_digest,
        "components": dict(components),
        "graph": row.graph_digest,
        "publisher": row.publisher,
    }
    if is_reserved_owner(repo.partition("/")[0]):
        claims[RECEIPT_PLATFORM] = True
    row.receipt = jwt.encode(claims, private_key, algorithm=RECEIPT_ALGORITHM, headers={"kid": kid, "typ": RECEIPT_TYP})
    row.receipt_kid = kid


def _resign(session: Session, keys: KeyRing, *, issuer: str, retired_kid: str) -> int:
    """Re-sign every receipt ``retired_kid`` signed with the current signing key; returns how many.

    After the retirement, in its transaction: the claims are rebuilt from the
    record (they are the same facts), only ``kid`` and signature change.
    """
    signer = keys.signing_key(session)
    count, after = 0, 0
    while True:
        rows = session.execute(
            select(CompiledGraph, Repo.owner, Repo.name)
            .join(Repo, Repo.id == CompiledGraph.repo_id)
            .where(CompiledGraph.receipt_kid == retired_kid, CompiledGraph.id > after)
            .order_by(CompiledGraph.id)
            .limit(_RESIGN_BATCH)
        ).all()
        if not rows:
            return count
        components: dict[int, list[tuple[str, str]]] = {}
        for record_id, name, digest in session.execute(
            select(CompiledGraphComponent.record_id, CompiledGraphComponent.name, CompiledGraphComponent.digest).where(
                CompiledGraphComponent.record_id.in_([row.id for row, _, _ in rows])
            )
        ):
            components.setdefault(record_id, []).append((name, digest))
        for row, owner, name in rows:
            _sign(signer, issuer=issuer, repo=f"{owner}/{name}", row=row, components=components.get(row.id, []))
        count += len(rows)
        after = rows[-1][0].id


@dataclass(frozen=True)
class ReceiptCheck:
    """A record's receipt as a reader sees it: its claims (decoded, whether or not it verifies), and the verdict."""

    kid: str | None
    claims: dict[str, Any] | None
    verifies: bool
    reason: str | None


def check(record: Record, jwks: list[dict[str, str]], *, issuer: str) -> ReceiptCheck:
    """Does ``record``'s receipt verify against ``jwks`` (the current ``GET /v1/keys``) and vouch for the record?

    Exactly the worker's offline check (``cgstore_client.receipts.verify_receipt``).
    """
    if record.receipt is None:
        return ReceiptCheck(None, None, False, "the record has no receipt")
    try:
        kid = jwt.get_unverified_header(record.receipt).get("kid")
        claims = jwt.decode(record.receipt, options={"verify_signature": False})
    except jwt.PyJWTError as err:
        return ReceiptCheck(None, None, False, f"not a JWS: {err}")
    try:
        verify_receipt(
            record.receipt,
            {"keys": jwks},
            expect_key=record.key,
            expect_artifact=record.manifest.artifact.digest,
            expect_components={c.name: c.digest for c in record.manifest.components},
            expect_issuer=issuer,
            expect_repo=record.repo,
        )
    except ReceiptInvalid as err:
        return ReceiptCheck(kid if isinstance(kid, str) else None, claims, False, str(err))
    return ReceiptCheck(kid, claims, True, None)
