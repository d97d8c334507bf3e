"""``POST /v1/owners``: claim an owner slug for the calling principal (docs/protocol.md, "Names"). Thin."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from cgstore.context import StoreContext, get_context
from cgstore.core.http import json_body, read_json
from cgstore.owners import service
from cgstore.tokens.claims import Claims
from cgstore.tokens.dependencies import require_claims
from cgstore_client.wire.owners import OwnerClaim, OwnerInfo

router = APIRouter(prefix="/v1/owners", tags=["owners"])


@router.post("", status_code=201, response_model=OwnerInfo, openapi_extra=json_body(OwnerClaim))
async def claim_owner(
    request: Request, claims: Claims = Depends(require_claims), ctx: StoreContext = Depends(get_context)
) -> OwnerInfo:
    """Claim an owner slug for the calling principal."""
    body = await read_json(request, OwnerClaim, ctx.settings.max_json_bytes)
    owner = await run_in_threadpool(service.claim_owner, ctx.db, claims, body.slug)
    return OwnerInfo(slug=owner.slug, principal=owner.principal, created_at=owner.created_at)
