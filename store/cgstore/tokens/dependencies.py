"""The auth dependency: every protected route gets verified ``Claims`` or an error.

No token: 401 ``UNAUTHORIZED``. Two ``Authorization`` headers: 400 ``BAD_REQUEST``. Anything wrong with the token: 401
``TOKEN_INVALID`` (never a silent downgrade to anonymous). The token is
verified on every request, revocation and key retirement included. The
verified claims ride on ``request.state.claims`` so a refusal is audited
under its actor and jti; the token itself goes nowhere else.
"""

from __future__ import annotations

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from cgstore.context import StoreContext, get_context
from cgstore.core.errors import BadRequest, TokenInvalid, Unauthorized
from cgstore.tokens.claims import Claims


async def require_claims(request: Request, ctx: StoreContext = Depends(get_context)) -> Claims:
    headers = request.headers.getlist("authorization")
    if len(headers) > 1:
        # "The first one wins" would let a proxy and the store disagree on who is asking.
        raise BadRequest("more than one Authorization header")
    header = headers[0] if headers else None
    if not header:
        raise Unauthorized("this route needs a bearer token")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise TokenInvalid("Authorization header is not 'Bearer <token>'")
    claims = await run_in_threadpool(ctx.tokens.verify, token.strip())
    request.state.claims = claims
    return claims
