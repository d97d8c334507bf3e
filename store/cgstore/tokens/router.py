"""HTTP endpoints of the token lifecycle and the key ring (docs/protocol.md, "Tokens"). Thin.

``/tokens`` (mint, list, revoke) need an admin token; ``/tokens/attenuate`` is
called with the parent token itself; ``/keys`` (the JWKS) needs no token, like
the capabilities. No answer ever carries a private key, and only a mint or an
attenuation answer carries a signed token (the new one): those two say
``Cache-Control: no-store``.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from cgstore.access import is_admin
from cgstore.context import StoreContext, get_context
from cgstore.core.http import QueryInt, json_body, read_json
from cgstore.mirror.trust import trusted_keys
from cgstore.tokens import service
from cgstore.tokens.claims import MAX_JTI_LEN, MAX_SUB_LEN, Claims
from cgstore.tokens.dependencies import require_claims
from cgstore_client.wire.tokens import (
    DEFAULT_TOKEN_PAGE,
    MAX_TOKEN_PAGE,
    AttenuateRequest,
    GrantSpec,
    Jwk,
    Jwks,
    KeyStatements,
    MintRequest,
    MintResponse,
    RevokeResponse,
    TokenInfo,
    TokenList,
)

router = APIRouter(prefix="/v1", tags=["tokens"])


@router.post("/tokens", status_code=201, response_model=MintResponse, openapi_extra=json_body(MintRequest))
async def mint_token(
    request: Request,
    response: Response,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> MintResponse:
    """Mint a token (admin)."""
    is_admin(claims).enforce()
    _not_stored(response)
    body = await read_json(request, MintRequest, ctx.settings.max_json_bytes)
    minted = await run_in_threadpool(
        ctx.tokens.mint, body.sub, _grants(body.grants), body.ttl_s, body.platform, actor=claims
    )
    return MintResponse(token=minted.token, jti=minted.jti, exp=minted.exp)


@router.post(
    "/tokens/attenuate", status_code=201, response_model=MintResponse, openapi_extra=json_body(AttenuateRequest)
)
async def attenuate_token(
    request: Request,
    response: Response,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> MintResponse:
    """Mint a child of the calling token, never wider than it."""
    _not_stored(response)
    body = await read_json(request, AttenuateRequest, ctx.settings.max_json_bytes)
    minted = await run_in_threadpool(ctx.tokens.attenuate, claims, _grants(body.grants), body.ttl_s, body.platform)
    return MintResponse(token=minted.token, jti=minted.jti, exp=minted.exp)


@router.get("/tokens", response_model=TokenList)
async def list_tokens(
    sub: str | None = Query(None, max_length=MAX_SUB_LEN),
    cursor: str | None = Query(None, max_length=MAX_JTI_LEN),
    limit: Annotated[QueryInt, Query(ge=1, le=MAX_TOKEN_PAGE)] = DEFAULT_TOKEN_PAGE,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> TokenList:
    """Every recorded token, never the token itself (admin)."""
    is_admin(claims).enforce()
    page = await run_in_threadpool(ctx.tokens.list_tokens, sub, cursor=cursor, limit=limit)
    return TokenList(tokens=[_info(info) for info in page.tokens], next_cursor=page.next_cursor)


@router.delete("/tokens/{jti}", response_model=RevokeResponse)
async def revoke_token(
    jti: str, claims: Claims = Depends(require_claims), ctx: StoreContext = Depends(get_context)
) -> RevokeResponse:
    """Revoke a token and every token attenuated from it."""
    is_admin(claims).enforce()
    revoked = await run_in_threadpool(ctx.tokens.revoke, jti, actor=claims)
    return RevokeResponse(revoked=revoked)


@router.get("/keys", response_model=Jwks)
async def keys(ctx: StoreContext = Depends(get_context)) -> Jwks:
    """The store's public keys (JWKS): verify tokens and receipts offline (a mirror's lists its upstream's too).

    A regional mirror adds the upstream keys it trusts, which signed the receipts it serves."""
    jwks = await run_in_threadpool(_jwks, ctx)
    return Jwks(keys=[Jwk(**key) for key in jwks])


@router.get("/keys:statements", response_model=KeyStatements)
async def key_statements(ctx: StoreContext = Depends(get_context)) -> KeyStatements:
    """The JWKS signed by each key this store signs with: a mirror adopts a rotation announced under a key it trusts."""
    return KeyStatements(statements=await run_in_threadpool(_statements, ctx))


def _statements(ctx: StoreContext) -> list[str]:
    with ctx.db.session() as session:
        return ctx.tokens.ring.key_statements(session, ctx.settings.token_issuer, int(time.time()))


def _not_stored(response: Response) -> None:
    """An answer carrying a token is kept by no cache, shared or private (RFC 9111 ``no-store``)."""
    response.headers["Cache-Control"] = "no-store"


def _jwks(ctx: StoreContext) -> list[dict[str, str]]:
    with ctx.db.session() as session:
        own = ctx.tokens.ring.jwks(session)
    if ctx.settings.upstream_url is None:
        return own
    # The upstream's receipts verify against these; they authenticate nothing here (tokens are checked
    # against this store's own key table, never this answer).
    kids = {key["kid"] for key in own}
    return own + [key for key in trusted_keys(ctx.db) if key.get("kid") not in kids]


def _grants(grants: list[GrantSpec]) -> list[dict]:
    return [grant.model_dump() for grant in grants]


def _info(info: service.TokenInfo) -> TokenInfo:
    return TokenInfo(
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
