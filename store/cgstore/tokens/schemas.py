"""Request and response bodies of the ``/v1/tokens`` endpoints.

Structure only: the grant patterns and actions are checked by
``grants.parse_grants`` inside the service (400 with a precise message), so
the rules live in one place. Pass ``[g.model_dump() for g in body.grants]``.
"""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel, ConfigDict, Field

from cgstore.tokens.grants import MAX_GRANTS
from cgstore.tokens.service import MAX_SUB_LEN, MAX_TTL_S, TokenInfo


class GrantSpec(BaseModel):
    """``{"repo": "<owner>/<glob>", "actions": [...]}``."""

    model_config = ConfigDict(extra="forbid")

    repo: str = Field(description="<owner>/<repo glob>; globs know only * and ?")
    actions: list[str] = Field(min_length=1, description="read, write, owner:create, admin")


class MintRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sub: str = Field(min_length=1, max_length=MAX_SUB_LEN, description="The principal the token speaks for.")
    grants: list[GrantSpec] = Field(max_length=MAX_GRANTS)
    ttl_s: int = Field(gt=0, le=MAX_TTL_S, strict=True)
    platform: bool = Field(
        False, strict=True, description="Set plt and register sub as a platform principal."
    )


class MintResponse(BaseModel):
    token: str
    jti: str
    exp: int = Field(description="Expiry, seconds since the epoch (the JWT exp claim).")


class AttenuateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grants: list[GrantSpec] = Field(max_length=MAX_GRANTS)
    ttl_s: int = Field(gt=0, le=MAX_TTL_S, strict=True)


class TokenInfoResponse(BaseModel):
    """One token of ``GET /v1/tokens``; never the signed token itself."""

    jti: str
    sub: str
    parent: str | None
    platform: bool
    grants: list[GrantSpec]
    issued_at: dt.datetime
    expires_at: dt.datetime
    revoked_at: dt.datetime | None
    status: str = Field(description="active, expired or revoked")

    @classmethod
    def from_info(cls, info: TokenInfo) -> TokenInfoResponse:
        return cls(
            jti=info.jti,
            sub=info.sub,
            parent=info.parent_jti,
            platform=info.platform,
            grants=[GrantSpec(**grant) for grant in info.grants],
            issued_at=info.issued_at,
            expires_at=info.expires_at,
            revoked_at=info.revoked_at,
            status=info.status,
        )


class TokenListResponse(BaseModel):
    tokens: list[TokenInfoResponse]


class RevokeResponse(BaseModel):
    revoked: int = Field(description="Tokens newly revoked: the token and its descendants.")
