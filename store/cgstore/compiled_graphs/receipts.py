"""Signing publish receipts: the store's statement that it admitted a record, checkable offline.

The claims, header and their meaning are the client package's
(``cgstore_client.receipts``, where they are verified): this module only signs
them, with the key ring that signs cap-tokens (``tokens/keys.py``), so one
JWKS (``GET /v1/keys``) verifies both. The ``typ`` and ``aud`` differ from a
cap-token's, and ``TokenService.verify`` refuses the receipt ``typ``: a receipt
never authenticates anyone.

A receipt is signed in the publish transaction and kept on the record row, so
a 200 re-publish and every resolve hit answer the very bytes the 201 did.
"""

from __future__ import annotations

from collections.abc import Iterable

import jwt
from cgstore_client.receipts import RECEIPT_ALGORITHM, RECEIPT_AUDIENCE, RECEIPT_TYP
from sqlalchemy.orm import Session

from cgstore.compiled_graphs.models import CompiledGraph
from cgstore.tokens.keys import KeyRing


def sign(
    session: Session, keys: KeyRing, *, issuer: str, repo: str, row: CompiledGraph,
    components: Iterable[tuple[str, str]],
) -> str:
    """A compact JWS over ``row`` (published in ``repo``) and its ``(name, digest)`` components."""
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
    return jwt.encode(claims, private_key, algorithm=RECEIPT_ALGORITHM, headers={"kid": kid, "typ": RECEIPT_TYP})
