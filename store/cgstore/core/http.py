"""HTTP plumbing shared by every router: the one error mapping, bounded JSON bodies, Range headers.

``install_error_handlers`` is the single place where exceptions become
responses: ``StoreError`` subclasses carry their protocol code and status;
database and storage outages become 503 ``UNAVAILABLE`` with ``Retry-After``;
request validation failures become 400 with the protocol's error body. Refusals
(401, 403, and 404s that hide a denial) are audited here.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import Any, TypeVar

import anyio.from_thread

import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cgstore.audit.service import record_denial
from cgstore.core.errors import (
    BadRequest,
    RangeInvalid,
    SizeInvalid,
    StoreError,
    TooLarge,
    Unavailable,
    error_body,
)

log = logging.getLogger(__name__)
Model = TypeVar("Model", bound=BaseModel)

_HTTP_CODES = {404: "NAME_UNKNOWN", 405: "UNSUPPORTED", 413: "TOO_LARGE"}

# The error body every refusal carries, documented once for the served OpenAPI schema.
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message", "detail"],
            "properties": {"code": {"type": "string"}, "message": {"type": "string"}, "detail": {"type": "object"}},
        }
    },
}
#: ``FastAPI(responses=...)``: the statuses any route may refuse with, each with the error body.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": description, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
    for status, description in (
        (400, "malformed request (NAME_INVALID, DIGEST_INVALID, SIZE_INVALID, BAD_REQUEST, …)"),
        (401, "no token (UNAUTHORIZED) or a bad one (TOKEN_INVALID)"),
        (403, "the token does not allow it (DENIED, ROOT_RESERVED)"),
        (404, "absent, or not readable by the caller (BLOB_UNKNOWN, BLOB_UPLOAD_UNKNOWN, NAME_UNKNOWN)"),
        (405, "method not allowed (UNSUPPORTED)"),
        (409, "conflicts with what is stored (CONFLICT)"),
        (413, "over a limit (TOO_LARGE)"),
        (416, "range or offset not satisfiable (RANGE_INVALID)"),
        (503, "a dependency is down (UNAVAILABLE); retry after Retry-After seconds"),
    )
}
#: An answer whose meaning is its status and headers (no body), for ``responses=``.
NO_BODY = {"description": "no body: the status and headers are the answer"}


def error_response(err: StoreError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers())


def _is_denial(err: StoreError) -> bool:
    return err.status in (401, 403) or err.hides_denial


async def _audit_denial(request: Request, err: StoreError) -> None:
    claims = getattr(request.state, "claims", None)
    context = getattr(request.app.state, "context", None)
    if context is None:
        return
    await run_in_threadpool(
        record_denial,
        context.db,
        actor=claims.sub if claims else "-",
        jti=claims.jti if claims else None,
        action=f"{request.method} {getattr(request.scope.get('route'), 'path', request.url.path)}",
        target=request.url.path,
        outcome=err.code,
        detail={"message": err.message},
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StoreError)
    async def store_error(request: Request, err: StoreError) -> JSONResponse:
        if _is_denial(err):
            await _audit_denial(request, err)
        if isinstance(err, Unavailable):
            log.warning("unavailable: %s", err.message)
        return error_response(err)

    @app.exception_handler(sqlalchemy.exc.OperationalError)
    @app.exception_handler(sqlalchemy.exc.InterfaceError)
    @app.exception_handler(sqlalchemy.exc.TimeoutError)
    async def database_down(request: Request, err: Exception) -> JSONResponse:
        log.warning("database unavailable: %s", err)
        return error_response(Unavailable("the database is not answering; retry later"))

    @app.exception_handler(sqlalchemy.exc.DBAPIError)
    async def database_error(request: Request, err: sqlalchemy.exc.DBAPIError) -> JSONResponse:
        if err.connection_invalidated:
            return error_response(Unavailable("the database connection was lost; retry later"))
        log.exception("database error", exc_info=err)
        return error_response(StoreError("internal database error"))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(BadRequest("request does not match the schema", errors=_plain_errors(err.errors())))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, err: ClientDisconnect) -> JSONResponse:
        # Nobody reads this answer; the service has already discarded the partial upload.
        return error_response(SizeInvalid("client disconnected before the body was complete"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(err.status_code, "BAD_REQUEST")
        body = {"error": {"code": code, "message": str(err.detail), "detail": {}}}
        return JSONResponse(body, status_code=err.status_code, headers=getattr(err, "headers", None))


def _plain_errors(errors: Any) -> list[dict[str, Any]]:
    return [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", ""))} for e in errors][:20]


async def read_json(request: Request, model: type[Model], max_bytes: int) -> Model:
    """Parse a JSON body into ``model``, refusing bodies over ``max_bytes`` while they stream in."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise TooLarge(f"JSON body over {max_bytes} bytes", limit=max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise TooLarge(f"JSON body over {max_bytes} bytes", limit=max_bytes)
    try:
        return model.model_validate(json.loads(body or b"null"))
    except (ValueError, RecursionError) as err:
        if isinstance(err, ValidationError):
            raise BadRequest("request body does not match the schema", errors=_plain_errors(err.errors())) from None
        raise BadRequest("request body is not valid JSON") from None


_RANGE = re.compile(r"bytes=(\d*)-(\d*)", re.ASCII)


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``Range: bytes=a-b | a- | -n`` → half-open ``(start, end)``; None for the whole blob.

    Multiple ranges are not supported (416, like a range that cannot be satisfied).
    """
    if header is None:
        return None
    match = _RANGE.fullmatch(header.strip())
    if not match or match.group(1) == match.group(2) == "":
        raise RangeInvalid("unsupported Range header", range=header, size=size)
    first, last = match.groups()
    if first == "":
        length = int(last)
        if length == 0:
            raise RangeInvalid("empty suffix range", range=header, size=size)
        return max(size - length, 0), size
    start = int(first)
    end = size if last == "" else min(int(last) + 1, size)
    if start >= size or (last != "" and int(last) < start):
        raise RangeInvalid("range not satisfiable", range=header, size=size)
    return start, end


def body_chunks(request: Request, batch_bytes: int = 1 << 20) -> Iterator[bytes]:
    """The request body as a plain iterator, for a service running in a worker thread.

    Each step hops to the event loop once and gathers up to ``batch_bytes``, so
    a GiB costs about a thousand hops, and memory stays at one batch.
    A client that disconnects raises ``ClientDisconnect`` inside the service,
    whose writer then aborts.
    """
    stream = request.stream()

    async def next_batch() -> bytes | None:
        chunks, gathered = [], 0
        while gathered < batch_bytes:
            try:
                chunk = await stream.__anext__()
            except StopAsyncIteration:
                break
            chunks.append(chunk)
            gathered += len(chunk)
        # One copy into an exactly sized, immutable batch (none for a lone
        # chunk): writers may then keep batches by reference (the S3 writer
        # does while a blob may still fit one PUT), and nothing is regrown.
        return (chunks[0] if len(chunks) == 1 else b"".join(chunks)) if gathered else None

    while (batch := anyio.from_thread.run(next_batch)) is not None:
        yield batch


def declared_length(request: Request) -> int | None:
    value = request.headers.get("content-length")
    if value is None:
        return None
    if not value.isdigit():
        raise SizeInvalid("Content-Length is not a number")
    return int(value)
