"""HTTP endpoints of the blobs capability (docs/protocol.md "Blobs"). Thin: parse, call the service, answer."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import RedirectResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from cgstore.blobs import service
from cgstore.blobs.schemas import MissingAnswer, MissingQuery
from cgstore.context import StoreContext, get_context
from cgstore.core.http import (
    NO_BODY,
    declared_length,
    feed_body,
    json_body,
    parse_content_range,
    parse_range,
    read_json,
)
from cgstore.mirror import eviction
from cgstore.mirror import service as mirror
from cgstore.tokens.claims import Claims
from cgstore.tokens.dependencies import require_claims

router = APIRouter(prefix="/v1/repos/{owner}/{repo}", tags=["blobs"])

_BYTES = {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}
_DOWNLOAD_RESPONSES = {
    200: {"description": "the blob's bytes", **_BYTES},
    206: {"description": "the requested range of the blob's bytes", **_BYTES},
    307: {"description": "redirect to a presigned storage URL (S3)"},
}


def _blob_headers(digest: str, size: int) -> dict[str, str]:
    return {"Content-Length": str(size), "ETag": f'"{digest}"', "Accept-Ranges": "bytes"}


def _upload_headers(owner: str, repo: str, session_id: str, offset: int) -> dict[str, str]:
    # OCI's Range is inclusive ("0-<last byte>"); Upload-Offset says the same unambiguously.
    return {
        "Location": f"/v1/repos/{owner}/{repo}/uploads/{session_id}",
        "Range": f"0-{max(offset - 1, 0)}",
        "Upload-Offset": str(offset),
        "Upload-Id": session_id,
    }


@router.head("/blobs/{digest}", response_class=Response, responses={200: NO_BODY})
async def head_blob(
    owner: str,
    repo: str,
    digest: str,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """Whether the repo holds the blob, and its size (a miss and an unreadable blob look alike)."""
    location = await run_in_threadpool(mirror.locate_blob, ctx, claims, owner, repo, digest)
    return Response(status_code=200, headers=_blob_headers(location.digest, location.size))


@router.get("/blobs/{digest}", response_class=Response, responses=_DOWNLOAD_RESPONSES)
async def get_blob(
    owner: str,
    repo: str,
    digest: str,
    request: Request,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """Download a blob (ranges allowed; on S3, 307 to a presigned URL)."""
    location = await run_in_threadpool(mirror.locate_blob, ctx, claims, owner, repo, digest)
    if eviction.is_mirror(ctx):  # a mirror evicts what its workers stopped downloading
        await run_in_threadpool(eviction.note_served, ctx, location.digest)
    url = await run_in_threadpool(service.download_url, ctx, location)
    if url is not None:
        return RedirectResponse(url, status_code=307, headers={"ETag": f'"{location.digest}"'})
    byte_range = parse_range(request.headers.get("range"), location.size)
    start, end = byte_range or (0, location.size)
    headers = {**_blob_headers(location.digest, location.size), "Content-Length": str(end - start)}
    if byte_range is not None:
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{location.size}"
    return StreamingResponse(
        service.read(ctx, location, start, end),
        status_code=206 if byte_range else 200,
        headers=headers,
        media_type="application/octet-stream",
    )


@router.post("/blobs:missing", response_model=MissingAnswer, openapi_extra=json_body(MissingQuery))
async def missing_blobs(
    owner: str,
    repo: str,
    request: Request,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> MissingAnswer:
    """Which of the given digests the repo lacks: what a publisher still has to upload."""
    query = await read_json(request, MissingQuery, ctx.settings.max_json_bytes)
    missing = await run_in_threadpool(service.missing, ctx, claims, owner, repo, query.digests)
    return MissingAnswer(missing=missing)


@router.put("/blobs/{digest}", status_code=201, response_class=Response)
async def put_blob(
    owner: str,
    repo: str,
    digest: str,
    request: Request,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """Upload a whole blob; stored only if its blake3 digest and size match."""
    size = await feed_body(request, service.upload(ctx, claims, owner, repo, digest, declared_length(request)))
    return Response(status_code=201, headers=_created_headers(owner, repo, digest, size))


def _created_headers(owner: str, repo: str, digest: str, size: int) -> dict[str, str]:
    return {"Location": f"/v1/repos/{owner}/{repo}/blobs/{digest}", "ETag": f'"{digest}"', "Blob-Size": str(size)}


@router.post("/blobs/{digest}:mount", status_code=201, response_class=Response)
async def mount_blob(
    owner: str,
    repo: str,
    digest: str,
    # No length bound here: the service's name grammar bounds it and answers NAME_INVALID.
    source: str = Query(alias="from"),
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """Link a blob the caller can read in another repo into this one, without uploading it."""
    size = await run_in_threadpool(service.mount, ctx, claims, owner, repo, digest, source)
    return Response(status_code=201, headers=_created_headers(owner, repo, digest, size))


@router.post("/uploads", status_code=202, response_class=Response)
async def open_upload(
    owner: str,
    repo: str,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """Open a resumable upload session."""
    session_id = await run_in_threadpool(service.open_session, ctx, claims, owner, repo)
    return Response(status_code=202, headers=_upload_headers(owner, repo, session_id, 0))


@router.patch("/uploads/{session_id}", status_code=202, response_class=Response)
async def upload_chunk(
    owner: str,
    repo: str,
    session_id: str,
    request: Request,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """Append a chunk at the session's offset (`Upload-Offset`)."""
    content_range = parse_content_range(request.headers.get("content-range"))
    offset = await feed_body(request, service.append(ctx, claims, owner, repo, session_id, content_range))
    return Response(status_code=202, headers=_upload_headers(owner, repo, session_id, offset))


@router.get("/uploads/{session_id}", status_code=204, response_class=Response)
async def upload_status(
    owner: str,
    repo: str,
    session_id: str,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """The session's offset, to resume after a dropped connection."""
    offset = await run_in_threadpool(service.session_offset, ctx, claims, owner, repo, session_id)
    return Response(status_code=204, headers=_upload_headers(owner, repo, session_id, offset))


@router.put("/uploads/{session_id}", status_code=201, response_class=Response)
async def commit_upload(
    owner: str,
    repo: str,
    session_id: str,
    request: Request,
    digest: str = Query(),  # its grammar (DIGEST_INVALID) bounds it, in the service
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """Commit the session as the blob of the given digest, verified."""
    size = await feed_body(request, service.commit_session(ctx, claims, owner, repo, session_id, digest))
    return Response(status_code=201, headers=_created_headers(owner, repo, digest, size))


@router.delete("/uploads/{session_id}", status_code=204, response_class=Response)
async def cancel_upload(
    owner: str,
    repo: str,
    session_id: str,
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> Response:
    """Cancel the session and reclaim its staged bytes."""
    await run_in_threadpool(service.cancel_session, ctx, claims, owner, repo, session_id)
    return Response(status_code=204)
