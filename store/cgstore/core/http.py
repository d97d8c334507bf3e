"""HTTP plumbing shared by every router: the one error mapping, bounded JSON bodies, Range headers.

``install_error_handlers`` is the single place where exceptions become
responses: ``StoreError`` subclasses carry their protocol code and status;
database and storage outages become 503 ``UNAVAILABLE`` with ``Retry-After``;
request validation failures become 400 with the protocol's error body; anything
else is the last resort, 500 ``INTERNAL`` without detail (logged and counted). Refusals
(401, 403, and 404s that hide a denial) are handed to the ``on_denial`` hook the
app installs (the audit feature's), so ``core`` imports no feature.

Request bodies are read here too, always on the event loop (``feed_body``):
a client that stalls mid-body costs a connection and at most one batch of
memory, never a worker thread.
"""

from __future__ import annotations

import datetime as dt
import inspect
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import Annotated, Any, TypeVar

import anyio
import sqlalchemy.exc
from cgstore_client.errors import CgstoreError
from cgstore_client.keys import strict_json_loads
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, BeforeValidator, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cgstore.core.errors import (
    BadRequest,
    RangeInvalid,
    RequestTimeout,
    SizeInvalid,
    StoreError,
    TooLarge,
    Unavailable,
    error_body,
    from_client_error,
)
from cgstore.core.inputs import check_text

log = logging.getLogger(__name__)
Model = TypeVar("Model", bound=BaseModel)
T = TypeVar("T")
#: Called with every refusal before it is answered (the app registers the audit here).
DenialHook = Callable[[Request, StoreError], Awaitable[None]]
#: A refusal as a page, for a request a person's browser made (the console's); None: the JSON body.
PageHook = Callable[[Request, StoreError], Response | None]

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


def error_doc(description: str) -> dict[str, Any]:
    """A ``responses=`` entry: a refusal with the error body (a route adds the statuses only it answers)."""
    return {"description": description, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}


#: ``FastAPI(responses=...)``: the statuses any route may refuse with, each with the error body.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: error_doc(description)
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


def error_response(err: StoreError, request: Request | None = None) -> JSONResponse:
    """The protocol's error body. A refusal sent before the request body was read closes the
    connection (RFC 9112 §9.6): the client may still be sending a body nobody will read, and
    must not wait for the keep-alive timeout to learn that the answer is final."""
    response = JSONResponse(error_body(err), status_code=err.status, headers=err.headers())
    if request is not None and _body_unread(request):
        response.headers["connection"] = "close"
    return response


def _body_unread(request: Request) -> bool:
    """Whether the request announced a body that ``body_batches`` has not read to its end."""
    if getattr(request.state, "body_read", False):
        return False
    declared = request.headers.get("content-length", "0").strip()
    return "transfer-encoding" in request.headers or declared not in ("", "0")


def _is_denial(err: StoreError) -> bool:
    """Refusals, and every 404: a miss that hides a denial and one that does not must do the
    same work on the request path (the hook tells them apart only when it writes, later)."""
    return err.status in (401, 403, 404) or err.hides_denial


def install_error_handlers(app: FastAPI, on_denial: DenialHook | None = None, as_page: PageHook | None = None) -> None:
    """Map every error to the protocol's body; refusals also go to ``on_denial`` (the audit).

    ``as_page`` may answer a refusal with a page instead (the console's pages, refused
    before their route ran: by the app-wide input rule).

    Call before adding the metrics middleware, so that it counts the last resort's 500s.
    """
    # Not ``exception_handler(Exception)``: Starlette re-raises after that handler answers,
    # so the server logs the traceback twice and drops the keep-alive connection.
    app.add_middleware(LastResort)

    @app.exception_handler(StoreError)
    async def store_error(request: Request, err: StoreError) -> Response:
        if err.status in (401, 403):
            request.app.state.context.metrics.denials.labels(err.code).inc()
        if on_denial is not None and _is_denial(err):
            await on_denial(request, err)
        if isinstance(err, Unavailable):
            # The cause (paths, endpoints) is for the operator's log, never the client's body.
            log.warning("unavailable: %s (%s)", err.message, err.__cause__)
        page = as_page(request, err) if as_page is not None else None
        return page if page is not None else error_response(err, request)

    @app.exception_handler(CgstoreError)
    async def contract_refusal(request: Request, err: CgstoreError) -> JSONResponse:
        # A refusal of the client package's contract code (archive reader, key
        # derivation) that a service did not translate itself: still its protocol code.
        return error_response(from_client_error(err), request)

    @app.exception_handler(sqlalchemy.exc.OperationalError)
    @app.exception_handler(sqlalchemy.exc.InterfaceError)
    @app.exception_handler(sqlalchemy.exc.TimeoutError)
    async def database_down(request: Request, err: Exception) -> JSONResponse:
        log.warning("database unavailable: %s", err)
        return error_response(Unavailable("the database is not answering; retry later"), request)

    @app.exception_handler(sqlalchemy.exc.DBAPIError)
    async def database_error(request: Request, err: sqlalchemy.exc.DBAPIError) -> JSONResponse:
        if err.connection_invalidated:
            return error_response(Unavailable("the database connection was lost; retry later"), request)
        return internal_error(request, err)

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


class LastResort:
    """Pure ASGI middleware: an exception no handler took still answers 500 ``INTERNAL`` as JSON."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as err:
            if started:
                raise  # half an answer is out: only dropping the connection tells the client
            await internal_error(Request(scope, receive), err)(scope, receive, send)


def internal_error(request: Request, err: Exception) -> JSONResponse:
    """500 ``INTERNAL`` with no detail: the traceback goes to the log and the count to ``/metrics``."""
    log.error("internal error answering %s %s", request.method, request.url.path, exc_info=err)
    request.app.state.context.metrics.internal_errors.inc()
    return error_response(StoreError("internal error"), request)


def _plain_errors(errors: Any) -> list[dict[str, Any]]:
    return [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", ""))} for e in errors][:20]


async def read_json(request: Request, model: type[Model], max_bytes: int) -> Model:
    """Parse a JSON body into ``model``, refusing bodies over ``max_bytes`` while they stream in."""
    declared = declared_length(request)
    if declared is not None and declared > max_bytes:
        raise TooLarge(f"JSON body over {max_bytes} bytes", limit=max_bytes)
    body = bytearray()
    async for chunk in body_batches(request, batch_bytes=max_bytes + 1):
        body += chunk
        if len(body) > max_bytes:
            raise TooLarge(f"JSON body over {max_bytes} bytes", limit=max_bytes)
    try:
        # Strictly UTF-8 (json.loads would guess UTF-16 from bytes), then the client's strict
        # parser: a body two parsers could read differently is refused, never judged one way.
        document = strict_json_loads((body or b"null").decode("utf-8"))
        check_text(document, "request body")
        return model.model_validate(document)
    except (ValueError, RecursionError) as err:
        if isinstance(err, ValidationError):
            raise BadRequest("request body does not match the schema", errors=_plain_errors(err.errors())) from None
        raise BadRequest("request body is not valid JSON", reason=str(err)[:MAX_ECHO_CHARS]) from None


#: Request bodies read with ``read_json`` (bounded) instead of FastAPI's unbounded body parameters.
_REQUEST_MODELS: dict[str, type[BaseModel]] = {}
_SCHEMA_REF = "#/components/schemas/{model}"


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting ``model`` as a route's JSON body (the route reads it with ``read_json``)."""
    _REQUEST_MODELS[model.__name__] = model
    schema = {"$ref": _SCHEMA_REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_request_schemas(app: FastAPI) -> None:
    """Add every ``json_body`` model (and the models it nests) to the served OpenAPI components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, model in _REQUEST_MODELS.items():
                document = model.model_json_schema(ref_template=_SCHEMA_REF)
                for nested, definition in document.pop("$defs", {}).items():
                    schemas.setdefault(nested, definition)
                schemas.setdefault(name, document)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


#: Longest decimal number accepted from a request (a header or a query): any
#: byte offset or size the store can hold fits in 19 digits (int64). Checked by
#: the grammar *before* ``int()``, so thousands of digits never reach the conversion.
MAX_NUMBER_DIGITS = 19
#: How much of a client's header is echoed back in an error's detail.
MAX_ECHO_CHARS = 64

_NUMBER = re.compile(rf"[0-9]{{1,{MAX_NUMBER_DIGITS}}}", re.ASCII)
_OPTIONAL_NUMBER = rf"([0-9]{{0,{MAX_NUMBER_DIGITS}}})"
# RFC 9110 §14.1.2: "bytes=" first-pos "-" [last-pos] | "bytes=-" suffix-length; the unit is case-insensitive.
_RANGE = re.compile(rf"bytes={_OPTIONAL_NUMBER}-{_OPTIONAL_NUMBER}", re.ASCII | re.IGNORECASE)
_RANGE_UNIT = re.compile(r"([!#$%&'*+.^_`|~0-9A-Za-z-]+)=", re.ASCII)
# OCI chunk ranges are inclusive "<start>-<end>"; a "bytes " prefix and a "/total" are tolerated.
_CONTENT_RANGE = re.compile(
    rf"(?:bytes[ =])?([0-9]{{1,{MAX_NUMBER_DIGITS}}})-([0-9]{{1,{MAX_NUMBER_DIGITS}}})"
    rf"(?:/(?:[0-9]{{1,{MAX_NUMBER_DIGITS}}}|\*))?",
    re.ASCII,
)


def echo(value: str) -> str:
    """A client-supplied value cut to a bounded length, for an error's detail."""
    return value[:MAX_ECHO_CHARS]


def parse_number(value: str) -> int | None:
    """A bounded, plain ASCII decimal (``str.isdigit`` would also pass "²"); None when it is not one."""
    return int(value) if _NUMBER.fullmatch(value) else None


def _ascii_number(value: object) -> object:
    """A query integer as typed: plain ASCII digits (pydantic alone reads " 4", "+4", "4_0" and "4.0" as 4)."""
    if isinstance(value, str):
        number = parse_number(value)
        if number is None:
            raise ValueError("must be a whole number in ASCII digits")
        return number
    return value


#: An integer query parameter: ASCII digits only, then the route's own bounds (``ge``, ``le``).
QueryInt = Annotated[int, BeforeValidator(_ascii_number)]


#: Largest row id, hence largest keyset cursor: both databases store ids as signed 64-bit integers,
#: and a bigger number would overflow the query's parameter (a 500) instead of being refused.
MAX_ROW_ID = 2**63 - 1


def parse_row_id(value: str) -> int | None:
    """A keyset cursor (a row id) from a request, within int64; None when it is not one."""
    number = parse_number(value)
    return number if number is not None and number <= MAX_ROW_ID else None


def parse_utc(moment: dt.datetime | None, name: str) -> dt.datetime | None:
    """A time from a query, in UTC (a time without an offset is read as UTC).

    Converted here, before any query: ``9999-12-31T23:59:59-14:00`` is a valid
    ISO 8601 time with no UTC spelling in ``datetime``'s range, and the database
    driver would raise ``OverflowError`` converting it.
    """
    if moment is None:
        return None
    if moment.tzinfo is None:
        return moment.replace(tzinfo=dt.UTC)
    try:
        return moment.astimezone(dt.UTC)
    except OverflowError:
        raise BadRequest(f"{name} is outside the representable range of times", **{name: moment.isoformat()}) from None


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``Range: bytes=a-b | a- | -n`` → half-open ``(start, end)``; None for the whole blob.

    RFC 9110 §14.2: a range unit other than ``bytes`` is ignored (the whole blob).
    Multiple ranges are not supported (416, like a range that cannot be
    satisfied). On an empty blob no range selects a byte, so every range is
    416: RFC 9110 calls a suffix range satisfiable there, but no Content-Range
    can describe the empty part it would select.
    """
    if header is None:
        return None
    header = header.strip()
    unit = _RANGE_UNIT.match(header)
    if unit is not None and unit.group(1).lower() != "bytes":
        return None
    match = _RANGE.fullmatch(header)
    if not match or match.group(1) == match.group(2) == "":
        raise RangeInvalid("unsupported Range header", range=echo(header), size=size)
    first, last = match.groups()
    if first == "":
        length = int(last)
        if length == 0 or size == 0:
            raise RangeInvalid("range not satisfiable", range=echo(header), size=size)
        return max(size - length, 0), size
    start = int(first)
    if start >= size or (last != "" and int(last) < start):
        raise RangeInvalid("range not satisfiable", range=echo(header), size=size)
    return start, size if last == "" else min(int(last) + 1, size)


def parse_content_range(header: str | None) -> tuple[int, int] | None:
    """OCI ``Content-Range: <start>-<end>`` (inclusive) → half-open ``(start, end)``; None when absent."""
    if header is None:
        return None
    match = _CONTENT_RANGE.fullmatch(header.strip())
    if not match or int(match.group(2)) < int(match.group(1)):
        raise RangeInvalid("Content-Range must be '<start>-<end>'", content_range=echo(header))
    return int(match.group(1)), int(match.group(2)) + 1


#: A body is read on the event loop and handed to a worker thread in batches of
#: this size: one thread hop per MiB, and memory stays at one batch per request.
BODY_BATCH_BYTES = 1 << 20

#: A service step that consumes a request body (the service never sees HTTP):
#: primed with ``next`` (its checks run before any byte is read), sent each
#: batch, then ``None`` at the end of the body; what it returns is the answer.
BodyConsumer = Generator[None, bytes | None, T]


async def body_batches(request: Request, batch_bytes: int = BODY_BATCH_BYTES) -> AsyncIterator[bytes]:
    """The request body in immutable batches of up to ``batch_bytes``, read on the event loop.

    A body that sends nothing for ``CGSTORE_BODY_IDLE_TIMEOUT_S`` raises
    ``RequestTimeout`` (408); a client that goes away raises ``ClientDisconnect``.
    """
    idle_s = request.app.state.context.settings.body_idle_timeout_s
    stream = request.stream()
    chunks: list[bytes] = []
    gathered = 0
    while True:
        try:
            with anyio.fail_after(idle_s):
                chunk = await anext(stream)
        except StopAsyncIteration:
            request.state.body_read = True  # an error answered now may keep the connection
            break
        except TimeoutError:
            raise RequestTimeout(f"the request body sent nothing for {idle_s:g} s", idle_timeout_s=idle_s) from None
        if chunk:
            chunks.append(chunk)
            gathered += len(chunk)
        if gathered >= batch_bytes:
            yield _joined(chunks)
            chunks, gathered = [], 0
    if gathered:
        yield _joined(chunks)


def _joined(chunks: list[bytes]) -> bytes:
    # One copy into an exactly sized, immutable batch (none for a lone chunk):
    # writers may then keep batches by reference (the S3 writer does while a
    # blob may still fit one PUT), and nothing is regrown.
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def feed_body(request: Request, consumer: BodyConsumer[T]) -> T:
    """Run ``consumer`` over the request body and return its answer.

    Each step of the consumer (its checks, each batch's write, the commit) is
    one short worker-thread call; the body is awaited on the event loop in
    between. So a slow or stalled client holds no thread, and token checks,
    reads and audit writes, which share the pool, are never starved by uploads.
    """
    try:
        await run_in_threadpool(next, consumer)
        async for batch in body_batches(request):
            await run_in_threadpool(consumer.send, batch)
        return await run_in_threadpool(_end_of_body, consumer)
    finally:
        if inspect.getgeneratorstate(consumer) != inspect.GEN_CLOSED:
            # Left mid-body (timeout, client gone, refusal, cancellation): closing
            # runs the consumer's ``with`` blocks, which abort its write, so
            # nothing is left behind. Shielded: a cancelled request still cleans up.
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(consumer.close)


def _end_of_body(consumer: BodyConsumer[T]) -> T:
    try:
        consumer.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a body consumer asked for bytes after the body ended")


def declared_length(request: Request) -> int | None:
    """The declared body size; a Content-Length that is not a bounded decimal is 400 ``SIZE_INVALID``."""
    value = request.headers.get("content-length")
    if value is None:
        return None
    number = parse_number(value.strip())
    if number is None:
        raise SizeInvalid("Content-Length is not a number", content_length=echo(value))
    return number
