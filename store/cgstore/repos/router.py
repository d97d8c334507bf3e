"""Repo endpoints: create or change a repo, and the destination-write preflight. Thin.

``PUT /v1/repos/{owner}/{repo} {"visibility"}``: 201 when it created the repo,
200 when it existed (its visibility now as asked). ``POST …/preflight``: 204
when this token could publish here now and for ``min_ttl_s`` more seconds,
else exactly the 401/403 a publish would get.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from cgstore.context import StoreContext, get_context
from cgstore.core.http import QueryInt, json_body, read_json
from cgstore.repos import service
from cgstore.tokens.claims import MAX_TTL_S, Claims
from cgstore.tokens.dependencies import require_claims
from cgstore_client.wire.owners import RepoInfo, RepoSettings

router = APIRouter(prefix="/v1/repos/{owner}/{repo}", tags=["repos"])

DEFAULT_MIN_TTL_S = 300


@router.put(
    "",
    response_model=RepoInfo,
    responses={201: {"model": RepoInfo, "description": "the repo was created"}},
    openapi_extra=json_body(RepoSettings),
)
async def configure_repo(
    owner: str,
    repo: str,
    request: Request,
    response: Response,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> RepoInfo:
    """Create or configure a repo (visibility: public to readers, or a private cache)."""
    body = await read_json(request, RepoSettings, ctx.settings.max_json_bytes)
    info = await run_in_threadpool(service.configure_repo, ctx.db, claims, owner, repo, body.visibility)
    response.status_code = 201 if info.created else 200
    return RepoInfo(
        owner=info.owner,
        name=info.name,
        visibility=info.visibility,
        created_by=info.created_by,
        created_at=info.created_at,
    )


@router.post("/preflight", status_code=204)
async def preflight(
    owner: str,
    repo: str,
    min_ttl_s: Annotated[QueryInt, Query(ge=0, le=MAX_TTL_S)] = DEFAULT_MIN_TTL_S,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """May this token publish here, for at least `min_ttl_s`? (before a long compile)"""
    await run_in_threadpool(service.preflight, ctx.db, claims, owner, repo, min_ttl_s, ctx.tokens.now())
    return Response(status_code=204)
