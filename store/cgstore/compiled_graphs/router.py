"""HTTP endpoints of the compiled-graphs capability (docs/protocol.md "Compiled graphs"). Thin: parse, call, answer.

Request and response bodies are the client package's wire types
(``cgstore_client.wire.records``), so the served OpenAPI schema is exactly
what the client parses.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from cgstore.compiled_graphs import events, publishing, records, reports, search
from cgstore.context import StoreContext, get_context
from cgstore.core.cursors import CURSOR_LEN
from cgstore.core.http import QueryInt, error_doc, json_body, read_json
from cgstore.mirror import service as mirror
from cgstore.tokens.claims import Claims
from cgstore.tokens.dependencies import require_claims
from cgstore_client.wire.discovery import DiscoverAnswer, DiscoverRequest, DriftReport
from cgstore_client.wire.fleet import MAX_EVENTS_WAIT_S, EventsAnswer
from cgstore_client.wire.records import (
    DEFAULT_LIST_LIMIT,
    MAX_LIST_LIMIT,
    MAX_RELEASE_CHARS,
    Manifest,
    PublishAnswer,
    Record,
    RecordPage,
    ResolveAnswer,
    ResolveRequest,
    YankRequest,
)

repo_router = APIRouter(prefix="/v1/repos/{owner}/{repo}/compiled-graphs", tags=["compiled-graphs"])
resolve_router = APIRouter(prefix="/v1", tags=["compiled-graphs"])

_JSON = "application/json"


def _json(model, status_code: int = 200) -> Response:
    # Serialized straight from the wire model (already validated when built);
    # the route's response_model still documents it in the OpenAPI schema.
    return Response(model.model_dump_json(), status_code=status_code, media_type=_JSON)


@repo_router.put(
    "/{key}",
    response_model=PublishAnswer,
    status_code=201,
    responses={200: {"model": PublishAnswer, "description": "the same bytes are already published under this key"}},
    openapi_extra=json_body(Manifest),
)
async def publish(
    owner: str,
    repo: str,
    key: str,
    request: Request,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """Publish a compiled-graph record under its ck1 key (admission checks the archive statically)."""
    manifest = await read_json(request, Manifest, ctx.settings.max_json_bytes)
    published = await run_in_threadpool(publishing.publish, ctx, claims, owner, repo, key, manifest)
    return _json(published.answer, 201 if published.created else 200)


@repo_router.get("/{key}", response_model=Record)
async def get_record(
    owner: str,
    repo: str,
    key: str,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """The live record of a key in this repo (a mirror pulls it from its upstream on a miss)."""
    return _json(await run_in_threadpool(mirror.get_record, ctx, claims, owner, repo, key))


@repo_router.get("", response_model=RecordPage)
async def list_records(
    owner: str,
    repo: str,
    family: str | None = Query(None, max_length=100),
    sm: str | None = Query(None, max_length=128),
    lane: str | None = Query(None, max_length=64),
    release: str | None = Query(None, max_length=MAX_RELEASE_CHARS),
    cursor: str | None = Query(None, max_length=CURSOR_LEN),
    limit: Annotated[QueryInt, Query(ge=1, le=MAX_LIST_LIMIT)] = DEFAULT_LIST_LIMIT,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """The repo's live records, newest first, paged."""
    page = await run_in_threadpool(
        records.list_records,
        ctx,
        claims,
        owner,
        repo,
        family=family,
        sm=sm,
        lane=lane,
        cursor=cursor,
        limit=limit,
        release=release,
    )
    return _json(page)


@repo_router.post("/{key}:yank", response_model=Record, openapi_extra=json_body(YankRequest))
async def yank(
    owner: str,
    repo: str,
    key: str,
    request: Request,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """Take a record out of resolve, with a reason (admin)."""
    body = await read_json(request, YankRequest, ctx.settings.max_json_bytes)
    return _json(await run_in_threadpool(records.yank, ctx, claims, owner, repo, key, body.reason, body.publisher))


@repo_router.post(
    "/{key}:report",
    response_model=Record,
    openapi_extra=json_body(DriftReport),
    responses={429: error_doc("too many reports from this token (UNAVAILABLE); retry after Retry-After seconds")},
)
async def report_drift(
    owner: str,
    repo: str,
    key: str,
    request: Request,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """Report that a served graph is not the live model (any reader; counted and audited, never yanks)."""
    body = await read_json(request, DriftReport, ctx.settings.max_json_bytes)
    return _json(await run_in_threadpool(reports.report_drift, ctx, claims, owner, repo, key, body))


@resolve_router.post("/compiled-graphs:resolve", response_model=ResolveAnswer, openapi_extra=json_body(ResolveRequest))
async def resolve(
    request: Request,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """Look up ck1 keys of a family: the best readable live record of each, or a miss."""
    query = await read_json(request, ResolveRequest, ctx.settings.max_json_bytes)
    urls_for = search.download_urls(ctx)
    return Response(await run_in_threadpool(mirror.resolve, ctx, claims, query, urls_for), media_type=_JSON)


@resolve_router.post(
    "/compiled-graphs:discover",
    response_model=DiscoverAnswer,
    openapi_extra=json_body(DiscoverRequest),
    responses={422: error_doc("a declaration no key could be derived from (ENVELOPE_INVALID, METADATA_INVALID)")},
)
async def discover(
    request: Request,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """Find live records by declaration (family, envelope, sm, toolchain), without a ck1 key: best first."""
    query = await read_json(request, DiscoverRequest, ctx.settings.max_json_bytes)
    urls_for = search.download_urls(ctx)
    return Response(await run_in_threadpool(mirror.discover, ctx, claims, query, urls_for), media_type=_JSON)


@resolve_router.get(
    "/compiled-graphs:events",
    response_model=EventsAnswer,
    responses={
        400: error_doc("a cursor not sealed for this reader, forged, or older than the feed keeps (BAD_REQUEST)"),
        503: error_doc("too many long-polls waiting on this process, or a dependency down (UNAVAILABLE)"),
    },
)
async def record_events(
    request: Request,
    family: str | None = Query(None, max_length=100),
    since: str | None = Query(None, max_length=CURSOR_LEN),
    wait: Annotated[QueryInt, Query(ge=0, le=MAX_EVENTS_WAIT_S)] = 0,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """Records published and yanked that the token may read, in commit order; long-polls up to `wait` seconds."""
    answer = await events.follow(
        ctx, claims, family=family, since=since, wait_s=wait, gone=lambda: _disconnected(request)
    )
    return _json(answer)


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (a GET's body is empty: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
