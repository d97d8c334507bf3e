"""HTTP endpoint of the admin views (docs/operations.md "Admin views"): ``GET /v1/admin/stats`` for admins. Thin."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from cgstore.admin import service
from cgstore.context import StoreContext, get_context
from cgstore.tokens.claims import Claims
from cgstore.tokens.dependencies import require_claims
from cgstore_client.wire.admin import AdminStats

router = APIRouter(prefix="/v1/admin", tags=["admin"])


@router.get("/stats", response_model=AdminStats)
async def stats(claims: Claims = Depends(require_claims), ctx: StoreContext = Depends(get_context)) -> AdminStats:
    """Admin views: records per family, sm and lane; bytes and dedup; top publishers; recent denials (admin)."""
    return await run_in_threadpool(service.read_stats, ctx, claims)
