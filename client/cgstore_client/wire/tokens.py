"""Bodies of ``/v1/tokens`` and ``/v1/keys`` (docs/protocol.md, "Tokens"), and their limits.

Structure only: grant patterns and actions are checked by the store's
``grants.parse_grants`` (400 with a precise message), so the grammar lives in
one place. The limits below are the store's: it imports them from here.
"""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel, ConfigDict, Field

MAX_TTL_S = 366 * 24 * 3600
MAX_SUB_LEN = 200
MAX_GRANTS = 64
#: Tokens per page of ``GET /v1/tokens``, and the default page.
MAX_TOKEN_PAGE = 1000
DEFAULT_TOKEN_PAGE = 100


class GrantSpec(BaseModel):
    """``{"repo": "<owner>/<glob>", "actions": [...]}``."""

    model_config = ConfigDict(extra="forbid")

    repo: str = Field(max_length=200, description="<owner>/<repo glob>; globs know only * and ?")
    actions: list[str] = Field(min_length=1, max_length=8, description="read, write, owner:create, admin")


class MintRequest(BaseModel):
    """``POST /v1/tokens`` (admin)."""

    model_config = ConfigDict(extra="forbid")

    sub: str = Field(min_length=1, max_length=MAX_SUB_LEN, description="The principal the token speaks for.")
    grants: list[GrantSpec] = Field(max_length=MAX_GRANTS)
    ttl_s: int = Field(gt=0, le=MAX_TTL_S, strict=True)
    platform: bool = Field(False, strict=True, description="Set plt and register sub as a platform principal.")


class MintResponse(BaseModel):
    """A new token. The only time the signed token is ever shown: the store keeps its claims, not it."""

    token: str
    jti: str
    exp: int = Field(description="Expiry, seconds since the epoch (the JWT exp claim).")


class AttenuateRequest(BaseModel):
    """``POST /v1/tokens/attenuate``, authenticated with the parent token."""

    model_config = ConfigDict(extra="forbid")

    grants: list[GrantSpec] = Field(max_length=MAX_GRANTS)
    ttl_s: int = Field(gt=0, le=MAX_TTL_S, strict=True)
    platform: bool | None = Field(
        None, strict=True, description="Absent: inherit the parent's plt; true: keep it (403 if absent); false: drop."
    )


class TokenInfo(BaseModel):
    """One token of ``GET /v1/tokens``; never the signed token itself."""

    jti: str
    sub: str
    parent: str | None
    platform: bool
    grants: list[GrantSpec]
    issued_at: dt.datetime
    expires_at: dt.datetime
    revoked_at: dt.datetime | None
    status: str = Field(description="active, expired or revoked (a token is revoked when any ancestor is)")


class TokenList(BaseModel):
    """One page of ``GET /v1/tokens``, oldest first."""

    tokens: list[TokenInfo]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null when this page is the last.")


class RevokeResponse(BaseModel):
    revoked: int = Field(description="Tokens newly revoked: the token and its descendants.")


class Jwk(BaseModel):
    """An Ed25519 public key (RFC 8037): never a private part."""

    kty: str = "OKP"
    crv: str = "Ed25519"
    x: str = Field(description="The raw public key, base64url without padding.")
    kid: str
    alg: str = "EdDSA"
    use: str = "sig"


class Jwks(BaseModel):
    """``GET /v1/keys``: every key that verifies now (retired keys are absent)."""

    keys: list[Jwk]


class KeyStatements(BaseModel):
    """``GET /v1/keys:statements``: the JWKS of ``GET /v1/keys`` signed by each key the store signs with (compact
    JWS, ``typ`` ``cgstore-keyset+jwt``, claims ``iss``, ``aud`` ``cgstore-keyset``, ``iat``, ``keys``). A key
    rotated in is thereby announced under the keys trusted before it: how a regional mirror follows a rotation."""

    statements: list[str]
