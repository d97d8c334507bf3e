"""What a verified cap-token says: its claims, their limits, and the digest its record keeps.

Pure: no database, no clock, no keys. ``TokenService`` builds ``Claims`` only
from a token it verified (or one it just signed).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cgstore.core.errors import BadRequest
from cgstore.tokens.grants import Grant, grant_allows, grant_allows_owner, grants_to_json
from cgstore_client.wire.tokens import MAX_SUB_LEN, MAX_TTL_S

AUDIENCE = "cgstore"
ALGORITHM = "EdDSA"
#: The header ``typ`` of a cap-token (a publish receipt has its own: ``cgstore_client.receipts``).
TOKEN_TYP = "JWT"
MAX_JTI_LEN = 64  # the tokens.jti column


@dataclass(frozen=True)
class Claims:
    """The verified claims of a cap-token (docs/protocol.md, "Tokens")."""

    iss: str
    aud: str
    sub: str
    iat: int
    exp: int
    jti: str
    plt: bool
    grants: tuple[Grant, ...]
    parent: str | None = None

    def allows(self, owner: str, repo: str, action: str) -> bool:
        """Whether a grant allows ``action`` on ``owner/repo`` (grants only: no root gate)."""
        return grant_allows(self.grants, owner, repo, action)

    def allows_owner(self, owner: str, action: str) -> bool:
        """Whether a grant over all of ``owner``'s repos (``owner/*``) allows ``action``."""
        return grant_allows_owner(self.grants, owner, action)

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "iss": self.iss,
            "aud": self.aud,
            "sub": self.sub,
            "iat": self.iat,
            "exp": self.exp,
            "jti": self.jti,
            "plt": self.plt,
            "grants": grants_to_json(self.grants),
        }
        if self.parent is not None:
            payload["parent"] = self.parent
        return payload


def claims_digest(payload: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of every claim a token carries.

    Computed over the payload exactly as signed (or decoded), unknown claims
    included, so that any claim added, removed or changed changes the digest.
    """
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def valid_sub(sub: object) -> bool:
    return (
        isinstance(sub, str)
        and 0 < len(sub) <= MAX_SUB_LEN
        and sub.isprintable()
        and sub == sub.strip()  # "alice " and "alice" must not be two principals
    )


def check_sub(sub: object) -> None:
    if not valid_sub(sub):
        raise BadRequest(f"principal name must be 1-{MAX_SUB_LEN} printable characters without surrounding whitespace")


def valid_jti(jti: object) -> bool:
    return isinstance(jti, str) and 0 < len(jti) <= MAX_JTI_LEN and jti.isascii() and jti.isalnum()


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_ttl(ttl_s: object) -> None:
    if not is_int(ttl_s) or not 0 < ttl_s <= MAX_TTL_S:
        raise BadRequest(f"ttl_s must be an integer in 1..{MAX_TTL_S} (366 days)")
