"""HTTP endpoints of mint claims (docs/api.md "Claims"). Thin: parse, call, answer.

``POST …/compiled-graphs:claim`` answers 201 when it granted the mint and 200
with the other states (``held``, ``published``, ``backoff``, ``failing``):
a claim that was not granted changed nothing the caller owns. Bodies are the
wire types of ``cgstore_client.wire.fleet``.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from starlette.concurrency import run_in_threadpool

from cgstore.claims import service
from cgstore.context import StoreContext, get_context
from cgstore.core.http import error_doc, json_body, read_json
from cgstore.tokens.claims import Claims
from cgstore.tokens.dependencies import require_claims
from cgstore_client.wire.fleet import (
    ClaimAnswer,
    ClaimGranted,
    ClaimHeartbeat,
    ClaimReleaseBody,
    ClaimReleased,
    ClaimRequest,
)

router = APIRouter(prefix="/v1/repos/{owner}/{repo}/compiled-graphs", tags=["claims"])

_JSON = "application/json"


def _json(model, status_code: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status_code, media_type=_JSON)


@router.post(
    ":claim",
    response_model=ClaimAnswer,
    responses={
        201: {"model": ClaimGranted, "description": "the caller holds the mint: beat it every heartbeat_s"},
        422: error_doc("a declaration no key could be derived from (ENVELOPE_INVALID, METADATA_INVALID)"),
    },
    openapi_extra=json_body(ClaimRequest),
)
async def claim(
    owner: str,
    repo: str,
    request: Request,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """Claim the mint of a declaration missed here: granted (201), or held, published, backoff, failing (200)."""
    body = await read_json(request, ClaimRequest, ctx.settings.max_json_bytes)
    answer = await run_in_threadpool(service.claim, ctx, claims, owner, repo, body)
    return _json(answer, 201 if answer.state == "granted" else 200)


@router.post("/claims/{claim}:heartbeat", response_model=ClaimHeartbeat)
async def heartbeat(
    owner: str,
    repo: str,
    claim: str,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """Keep a held claim alive for another TTL (its holder only; every heartbeat_s)."""
    return _json(await run_in_threadpool(service.heartbeat, ctx, claims, owner, repo, claim))


@router.post("/claims/{claim}:release", response_model=ClaimReleased, openapi_extra=json_body(ClaimReleaseBody))
async def release(
    owner: str,
    repo: str,
    claim: str,
    request: Request,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """End a held claim: published (with the key) or failed (with the reason; the next grant backs off)."""
    body = await read_json(request, ClaimReleaseBody, ctx.settings.max_json_bytes)
    return _json(await run_in_threadpool(service.release, ctx, claims, owner, repo, claim, body.root))
