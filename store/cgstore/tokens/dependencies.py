"""The auth dependency: every protected route gets verified ``Claims`` or an error.

No token: 401 ``UNAUTHORIZED``. Anything wrong with the token: 401
``TOKEN_INVALID`` (never a silent downgrade to anonymous). The token is
verified on every request, revocation and key retirement included. The
verified claims ride on ``request.state.claims`` so a refusal is audited
under its actor and jti; the token itself goes nowhere else.
"""

from __future__ import annotations

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from cgstore.context import StoreContext, get_context
from cgstore.core.errors import TokenInvalid, Unauthorized
from cgstore.tokens.claims import Claims


async def require_claims(request: Request, ctx: StoreContext = Depends(get_context)) -> Claims:
    header = request.headers.get("authorization")
    if not header:
        raise Unauthorized("this route needs a bearer token")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise TokenInvalid("Authorization header is not 'Bearer <token>'")
    claims = await run_in_threadpool(ctx.tokens.verify, token.strip())
    request.state.claims = claims
    return claims
