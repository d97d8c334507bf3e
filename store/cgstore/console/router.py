"""HTTP side of the admin console (docs/console.md): sign-in, sign-out, seven read-only pages, two static files.

Server-rendered HTML (Jinja2, autoescaped), no inline script or style, no
request leaving the store: ``ConsoleHeaders`` puts a strict CSP and the other
security headers on every answer under ``/console`` (errors and static files
included). Not in the OpenAPI schema: these are pages for people, not the API.

Sign-in keeps the admin token in a cookie (``HttpOnly``, ``SameSite=Strict``,
``Path=/console``, ``Secure`` over https, expiring with the token). Every page
verifies it again (``TokenService.verify``, as the bearer dependency does) and
enforces the admin rule, so an expired or revoked token is signed out at the
next page. The only state-changing requests are the sign-in and sign-out POSTs
and the overview's "Clear" of a failing declaration (``POST
/console/claims/{id}/clear``, audited as ``compiled_graph.claim.clear``);
``SameSite=Strict`` keeps the cookie off cross-site requests and a POST from
another origin (``Origin``, or ``Sec-Fetch-Site`` when the browser sends
``Origin: null``) is refused, so no CSRF token is needed.

Refusals are audited like the JSON API's (``audit.denials.audit_denial``: 401s
counted per source, 403s one row each); every page read by an admin is one
audit entry, ``GET /console/...``, with the page's path and query as target.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from starlette.concurrency import run_in_threadpool

from cgstore.access import is_admin
from cgstore.admin.service import RecordFilter
from cgstore.audit.denials import audit_denial
from cgstore.audit.service import AuditFilter
from cgstore.console import service
from cgstore.context import StoreContext, get_context
from cgstore.core.errors import BadRequest, Denied, StoreError, TokenInvalid, Unauthorized
from cgstore.core.urls import public_location
from cgstore.tokens.claims import Claims

PREFIX = "/console"
LOGIN = f"{PREFIX}/login"
#: The cookie holding the signed-in admin token (only ever sent to ``/console``).
COOKIE = "cgstore_console"
#: Browsers drop cookies over 4096 bytes (name and attributes included): a longer token cannot sign in.
MAX_COOKIE_TOKEN = 3800
#: Largest sign-in form read (a token is at most 16 KiB; anything longer is refused unread).
MAX_FORM_BYTES = 20 * 1024
#: Longest query value a page accepts (the JSON API's bound).
MAX_QUERY_CHARS = 1024

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-frame-options": "DENY",
    "cache-control": "no-store",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}
_RAW_HEADERS = [(name.encode(), value.encode()) for name, value in SECURITY_HEADERS.items()]

_HERE = Path(__file__).parent
TEMPLATES = Environment(
    loader=FileSystemLoader(_HERE / "templates"),
    autoescape=select_autoescape(default=True),
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
#: The static files, read once: name -> (bytes, media type). Nothing else is served.
_STATIC = {
    name: ((_HERE / "static" / name).read_bytes(), media_type)
    for name, media_type in (
        ("console.css", "text/css; charset=utf-8"),
        ("console.js", "text/javascript; charset=utf-8"),
    )
}


def _pretty(value: Any) -> str:
    """A stored document as indented JSON text (escaped by the template like any text)."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def _plain(value: Any, indent: str = "") -> str:
    """An audit entry's detail, its strings exactly as stored (already escaped by the audit: JSON would
    escape their backslashes once more), one ``key: value`` a line."""
    if isinstance(value, dict) and value:
        return "\n".join(
            f"{indent}{key}:"
            + ("\n" + _plain(item, indent + "  ") if isinstance(item, dict | list) and item else " " + _plain(item))
            for key, item in value.items()
        )
    if isinstance(value, list):
        return "\n".join(f"{indent}- " + _plain(item, indent + "  ").lstrip() for item in value) or "[]"
    if isinstance(value, dict):
        return "{}"
    return value if isinstance(value, str) else json.dumps(value)


def _bytes(size: int) -> str:
    """A size for people (the exact count is the cell's title)."""
    if size < 1024:
        return f"{size} bytes"
    value, unit = size / 1024, "KiB"
    for larger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:.1f} {unit}"


TEMPLATES.filters.update(pretty=_pretty, plain=_plain, bytes=_bytes)
NAV = (
    ("Overview", PREFIX),
    ("Records", f"{PREFIX}/records"),
    ("Audit", f"{PREFIX}/audit"),
    ("Tokens", f"{PREFIX}/tokens"),
    ("Storage", f"{PREFIX}/storage"),
    ("Explain", f"{PREFIX}/explain"),
)

router = APIRouter(include_in_schema=False)


class ConsoleHeaders:
    """Pure ASGI middleware: the security headers on every answer under ``/console``, whoever produced it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not _under_console(scope.get("path", "")):
            await self.app(scope, receive, send)
            return

        async def with_headers(message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if k.decode().lower() not in SECURITY_HEADERS]
                message = {**message, "headers": kept + _RAW_HEADERS}
            await send(message)

        await self.app(scope, receive, with_headers)


# -- rendering ------------------------------------------------------------------------------


def _render(template: str, status: int = 200, **context: Any) -> HTMLResponse:
    context.setdefault("claims", None)
    context.setdefault("error", None)
    context.setdefault("next_url", None)
    html = TEMPLATES.get_template(template).render(nav=NAV, **context)
    return HTMLResponse(html, status_code=status)


def _message(status: int, title: str, message: str, claims: Claims | None = None) -> HTMLResponse:
    return _render("message.html", status, title=title, message=message, claims=claims)


def _login_page(status: int = 200, error: str | None = None) -> HTMLResponse:
    return _render("login.html", status, error=error)


def _secure(request: Request) -> bool:
    # uvicorn sets the scheme from X-Forwarded-Proto when the proxy is trusted (--forwarded-allow-ips).
    return request.url.scheme == "https"


def _clear_cookie(response: Response, request: Request) -> Response:
    response.delete_cookie(COOKIE, path=PREFIX, secure=_secure(request), httponly=True, samesite="strict")
    return response


def _see_other(request: Request, path: str) -> RedirectResponse:
    """A 303 to one of the console's paths, under the public URL or relative (never from the ``Host`` header)."""
    return RedirectResponse(public_location(request.app.state.context.settings.public_url, path), status_code=303)


def _to_login(request: Request, *, clear: bool) -> Response:
    response = _see_other(request, LOGIN)
    return _clear_cookie(response, request) if clear else response


def _under_console(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_page(request: Request, err: StoreError) -> Response | None:
    """The app's page hook (``core.http.install_error_handlers``): a console request refused before its route
    ran (the app-wide input rule refuses a NUL in the query) gets a page, not the API's JSON body."""
    if not _under_console(request.url.path) or err.status != 400:
        return None
    return _message(400, "Bad request", err.message)


def _source(request: Request) -> str:
    return request.client.host if request.client else "-"


def _next_url(request: Request, cursor: str | None) -> str | None:
    """This page's URL with the same filters and ``cursor`` (the ``rel="next"`` link), or None."""
    if cursor is None:
        return None
    kept = [(k, v) for k, v in request.query_params.multi_items() if k != "cursor" and v]
    return f"{request.url.path}?{urlencode([*kept, ('cursor', cursor)])}"


def _query(request: Request, *names: str) -> dict[str, str | None]:
    """The named query values as typed in the form: an empty field is None; too long is ``BadRequest``."""
    values: dict[str, str | None] = {}
    for name in names:
        value = request.query_params.get(name, "").strip()
        if len(value) > MAX_QUERY_CHARS:
            raise BadRequest(f"{name} is longer than {MAX_QUERY_CHARS} characters")
        values[name] = value or None
    return values


# -- the signed-in admin ------------------------------------------------------------------------


async def _signed_in(request: Request, ctx: StoreContext) -> Claims | Response:
    """The verified admin claims of the cookie; else the answer to give (audited like the API's refusals)."""
    token = request.cookies.get(COOKIE)
    if not token:
        await audit_denial(request, Unauthorized("the console needs a sign-in"))
        return _to_login(request, clear=False)
    try:
        claims = await run_in_threadpool(ctx.tokens.verify, token)
    except TokenInvalid as err:  # expired, revoked, retired key...: signed out
        await audit_denial(request, err)
        return _to_login(request, clear=True)
    request.state.claims = claims
    decision = is_admin(claims)
    if not decision.allowed:
        await audit_denial(request, decision.refusal)
        return _clear_cookie(_forbidden(), request)
    return claims


def _forbidden(message: str = "The console is for admin tokens (a grant '*/*' with the admin action).") -> Response:
    return _message(403, "Forbidden", message)


async def _page(
    request: Request, ctx: StoreContext, template: str, build: Callable[[Claims], Any], **context: Any
) -> Response:
    """Sign-in check, the view built in a worker thread, the read audited, the page rendered.

    A bad filter renders the page with its error (400); an unknown record the Not found page.
    """
    claims = await _signed_in(request, ctx)
    if isinstance(claims, Response):
        return claims
    try:
        view = await run_in_threadpool(build, claims)
    except StoreError as err:
        if err.status == 404:
            return _message(404, "Not found", err.message, claims)
        if err.status != 400:
            raise
        return _render(template, 400, claims=claims, view=None, error=err.message, **context)
    route = getattr(request.scope.get("route"), "path", request.url.path)
    target = f"{request.url.path}?{request.url.query}" if request.url.query else request.url.path
    await run_in_threadpool(
        service.record_read, ctx, claims, action=f"GET {route}", target=target, source=_source(request)
    )
    return _render(
        template, claims=claims, view=view, next_url=_next_url(request, getattr(view, "next_cursor", None)), **context
    )


# -- sign-in and sign-out ------------------------------------------------------------------------


def _cross_origin(request: Request) -> bool:
    """Whether the POST comes from a page of another origin.

    ``Origin``, when it names one, must be the store's own: the one the request was sent
    to, or ``CGSTORE_PUBLIC_URL``'s (behind a proxy that forwards another ``Host``). Under
    ``Referrer-Policy: no-referrer`` a browser sends ``Origin: null`` even for its own forms,
    so then the browser's ``Sec-Fetch-Site`` decides (``same-origin``); a client sending
    neither header is no browser another site could have steered.
    """
    origin = request.headers.get("origin")
    if origin is not None and origin != "null":
        return origin not in _own_origins(request)
    site = request.headers.get("sec-fetch-site")
    return (origin is not None or site is not None) and site not in ("same-origin", "none")


def _own_origins(request: Request) -> set[str]:
    own = {f"{request.url.scheme}://{request.url.netloc}"}
    if public_url := request.app.state.context.settings.public_url:
        parsed = urlsplit(public_url)
        own.add(f"{parsed.scheme}://{parsed.netloc}")
    return own


async def _form(request: Request) -> dict[str, str]:
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/x-www-form-urlencoded":
        raise BadRequest("the sign-in form is sent as application/x-www-form-urlencoded")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise BadRequest(f"the form is larger than {MAX_FORM_BYTES} bytes")
    try:
        return dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True))
    except (UnicodeDecodeError, ValueError):
        raise BadRequest("the form is not URL-encoded UTF-8") from None


@router.get(LOGIN)
async def login_form() -> Response:
    return _login_page()


@router.post(LOGIN)
async def sign_in(request: Request, ctx: StoreContext = Depends(get_context)) -> Response:
    """Verify the token like any request's, require admin, keep it in the cookie until it expires."""
    if _cross_origin(request):
        await audit_denial(request, Denied("cross-origin sign-in form refused"))
        return _forbidden("A sign-in form from another site was refused.")
    try:
        token = (await _form(request)).get("token", "").strip()
    except BadRequest as err:
        return _login_page(400, err.message)
    if not token:
        return _login_page(401, "Paste an admin token.")
    try:
        claims = await run_in_threadpool(ctx.tokens.verify, token)
    except TokenInvalid as err:
        await audit_denial(request, err)
        return _login_page(401, f"That token was refused: {err.message}.")
    request.state.claims = claims
    decision = is_admin(claims)
    if not decision.allowed:
        await audit_denial(request, decision.refusal)
        return _forbidden()
    remaining = claims.exp - ctx.tokens.now()
    if remaining <= 0:
        return _login_page(401, "That token has expired.")
    if len(token) > MAX_COOKIE_TOKEN:
        return _login_page(
            400,
            f"That token is longer than a browser keeps in a cookie ({MAX_COOKIE_TOKEN} "
            "characters): mint an admin token with fewer grants.",
        )
    await run_in_threadpool(
        service.record_read, ctx, claims, action=f"POST {LOGIN}", target=LOGIN, source=_source(request)
    )
    response = _see_other(request, PREFIX)
    response.set_cookie(
        COOKIE,
        token,
        max_age=remaining,
        expires=remaining,
        path=PREFIX,
        secure=_secure(request),
        httponly=True,
        samesite="strict",
    )
    return response


@router.post(f"{PREFIX}/logout")
async def sign_out(request: Request) -> Response:
    if _cross_origin(request):
        await audit_denial(request, Denied("cross-origin sign-out form refused"))
        return _forbidden("A sign-out form from another site was refused.")
    return _to_login(request, clear=True)


@router.get(f"{PREFIX}/static/{{name}}")
async def static(name: str) -> Response:
    found = _STATIC.get(name)
    if found is None:
        return _message(404, "Not found", "The console serves no such file.")
    content, media_type = found
    return Response(content, media_type=media_type)


# -- pages ------------------------------------------------------------------------------------


@router.get(PREFIX)
async def overview(request: Request, ctx: StoreContext = Depends(get_context)) -> Response:
    return await _page(
        request,
        ctx,
        "overview.html",
        lambda claims: service.overview(ctx, claims),
        aggregates_s=ctx.settings.console_aggregates_s,
    )


@router.post(f"{PREFIX}/claims/{{slot}}/clear")
async def clear_claim(slot: str, request: Request, ctx: StoreContext = Depends(get_context)) -> Response:
    """Clear a failing declaration (its next claim is granted), then back to the overview."""
    if _cross_origin(request):
        await audit_denial(request, Denied("cross-origin clear form refused"))
        return _forbidden("A form from another site was refused.")
    claims = await _signed_in(request, ctx)
    if isinstance(claims, Response):
        return claims
    try:
        await run_in_threadpool(service.clear_failing, ctx, claims, slot)
    except StoreError as err:
        if err.status != 404:
            raise
        return _message(404, "Not found", err.message, claims)
    return _see_other(request, PREFIX)


RECORD_FILTERS = ("family", "sm", "lane", "repo", "publisher", "health")


@router.get(f"{PREFIX}/records")
async def records(request: Request, ctx: StoreContext = Depends(get_context)) -> Response:
    return await _filtered(
        request,
        ctx,
        "records.html",
        RECORD_FILTERS,
        lambda claims, q: service.records(
            ctx, claims, RecordFilter(**{name: q[name] for name in RECORD_FILTERS}), q["cursor"], q["limit"]
        ),
    )


@router.get(f"{PREFIX}/records/{{owner}}/{{repo}}/{{key}}")
async def record(
    owner: str, repo: str, key: str, request: Request, ctx: StoreContext = Depends(get_context)
) -> Response:
    return await _page(
        request,
        ctx,
        "record.html",
        lambda claims: service.record(ctx, claims, owner, repo, key),
        key=key,
        repo=f"{owner}/{repo}",
    )


AUDIT_FILTERS = ("actor", "jti", "repo", "action", "outcome", "source", "since", "until")


@router.get(f"{PREFIX}/audit")
async def audit_log(request: Request, ctx: StoreContext = Depends(get_context)) -> Response:
    def build(claims: Claims, q: dict[str, str | None]) -> service.AuditView:
        where = AuditFilter(
            actor=q["actor"],
            jti=q["jti"],
            repo=q["repo"],
            action=q["action"],
            outcome=q["outcome"],
            source=q["source"],
            since=service.parse_moment(q["since"], "since"),
            until=service.parse_moment(q["until"], "until"),
        )
        return service.audit_log(ctx, claims, where, q["cursor"], q["limit"])

    return await _filtered(request, ctx, "audit.html", AUDIT_FILTERS, build)


@router.get(f"{PREFIX}/tokens")
async def tokens(request: Request, ctx: StoreContext = Depends(get_context)) -> Response:
    return await _filtered(
        request,
        ctx,
        "tokens.html",
        ("sub",),
        lambda claims, q: service.tokens(ctx, claims, q["sub"], q["cursor"], q["limit"]),
    )


@router.get(f"{PREFIX}/storage")
async def storage(request: Request, ctx: StoreContext = Depends(get_context)) -> Response:
    return await _page(
        request,
        ctx,
        "storage.html",
        lambda claims: service.storage(ctx, claims),
        aggregates_s=ctx.settings.console_aggregates_s,
    )


@router.get(f"{PREFIX}/explain")
async def explain(request: Request, ctx: StoreContext = Depends(get_context)) -> Response:
    """Why a declaration misses, for this admin's token: a GET form, like the filters (it changes nothing)."""
    return await _filtered(
        request,
        ctx,
        "explain.html",
        service.EXPLAIN_FIELDS,
        lambda claims, q: service.explain_declaration(ctx, claims, q),
    )


async def _filtered(
    request: Request,
    ctx: StoreContext,
    template: str,
    filters: tuple[str, ...],
    build: Callable[[Claims, dict[str, str | None]], Any],
) -> Response:
    """A page with a filter form: the form shows what was asked, even when it was refused."""
    typed = {name: request.query_params.get(name, "") for name in filters}

    def with_query(claims: Claims) -> Any:
        return build(claims, _query(request, *filters, "cursor", "limit"))

    return await _page(request, ctx, template, with_query, query=typed)
