"""The store's own URLs: under the configured public URL (``CGSTORE_PUBLIC_URL``), else relative paths.

Never built from the request: its ``Host`` header is the client's word, and a
URL made of it (a redirect, a blob URL in a resolve answer) points wherever the
client, or a cache in front of the store that keyed on something else, said
(``Host: evil.example`` used to get a 307 to ``http://evil.example/console/login``).
A relative path needs no host at all: HTTP allows a relative ``Location`` and
the client resolves paths against the URL it called.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from starlette.routing import Match
from starlette.types import Receive, Scope, Send


def public_location(public_url: str | None, path: str) -> str:
    """``path`` (from the root: ``/console/login``) under ``public_url`` when one is set, else ``path`` itself."""
    return f"{public_url}{path}" if public_url else path


def _other_spelling(path: str) -> str | None:
    """``/a/`` for ``/a`` and back; None for the root and for ``//host…`` or ``/\\host…`` (a relative Location
    browsers read as naming a host)."""
    if path == "/" or path.startswith(("//", "/\\")):
        return None
    other = path.rstrip("/") if path.endswith("/") else path + "/"
    return other or None


def install_slash_redirects(app: FastAPI, public_url: str | None) -> None:
    """Starlette's redirect of ``/path/`` to ``/path`` (and back), its ``Location`` from :func:`public_location`.

    Starlette builds that redirect from the request's scheme and ``Host``; it is
    turned off and done here instead, where no route matched.
    """
    router = app.router
    router.redirect_slashes = False
    not_found = router.default

    async def redirect_or_not_found(scope: Scope, receive: Receive, send: Send) -> None:
        other = _other_spelling(scope["path"]) if scope["type"] == "http" else None
        if other is not None and any(
            route.matches({**scope, "path": other})[0] is not Match.NONE for route in router.routes
        ):
            query = scope.get("query_string", b"").decode("latin-1")
            location = public_location(public_url, other) + (f"?{query}" if query else "")
            await RedirectResponse(location, status_code=307)(scope, receive, send)
            return
        await not_found(scope, receive, send)

    router.default = redirect_or_not_found
