"""Signing publish receipts: the store's statement that it admitted a record, checkable offline.

The claims, header and their meaning are the client package's
(``cgstore_client.receipts``, where they are verified): this module only signs
them, with the key ring that signs cap-tokens (``tokens/keys.py``), so one
JWKS (``GET /v1/keys``) verifies both. The ``typ`` and ``aud`` differ from a
cap-token's, and ``TokenService.verify`` refuses the receipt ``typ``: a receipt
never authenticates anyone.

A receipt is signed at publish and kept on the record row (with the ``kid``
that signed it), so a 200 re-publish and every resolve hit answer the very
bytes the 201 did. Retiring a key would leave its receipts unverifiable:
``cgstore keys retire`` re-signs them with the current key in the same
transaction (``resign``), so a worker resolving again always gets a receipt
the JWKS verifies.
"""

from __future__ import annotations

from collections.abc import Iterable

import jwt
from cgstore_client.receipts import RECEIPT_ALGORITHM, RECEIPT_AUDIENCE, RECEIPT_TYP
from sqlalchemy import select
from sqlalchemy.orm import Session

from cgstore.compiled_graphs.models import CompiledGraph, CompiledGraphComponent
from cgstore.repos.models import Repo
from cgstore.tokens.keys import KeyRing

# Records re-signed per query when a key retires (bounded memory, whatever the table's size).
_RESIGN_BATCH = 500


def stamp(
    session: Session, keys: KeyRing, *, issuer: str, repo: str, row: CompiledGraph,
    components: Iterable[tuple[str, str]],
) -> None:
    """Sign ``row`` (published in ``repo``, with its ``(name, digest)`` components) and keep receipt and kid on it."""
    kid, private_key = keys.signing_key(session)
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
    row.receipt = jwt.encode(claims, private_key, algorithm=RECEIPT_ALGORITHM, headers={"kid": kid, "typ": RECEIPT_TYP})
    row.receipt_kid = kid


def resign(session: Session, keys: KeyRing, *, issuer: str, retired_kid: str) -> int:
    """Re-sign every receipt ``retired_kid`` signed with the current signing key; returns how many.

    Called in the transaction that retires the key, after it: the claims are
    rebuilt from the record (they are the same facts), only ``kid`` and
    signature change.
    """
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
            select(CompiledGraphComponent.record_id, CompiledGraphComponent.name, CompiledGraphComponent.digest)
            .where(CompiledGraphComponent.record_id.in_([row.id for row, _, _ in rows]))
        ):
            components.setdefault(record_id, []).append((name, digest))
        for row, owner, name in rows:
            stamp(session, keys, issuer=issuer, repo=f"{owner}/{name}", row=row, components=components.get(row.id, []))
        count += len(rows)
        after = rows[-1][0].id
