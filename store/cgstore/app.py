"""The app factory: builds the shared resources and mounts every feature's router."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import anyio.to_thread
from fastapi import Depends, FastAPI
from fastapi_offline import FastAPIOffline
from starlette.concurrency import run_in_threadpool

from cgstore import __version__
from cgstore.admin.router import router as admin_router
from cgstore.audit.denials import DenialLog, audit_denial
from cgstore.audit.router import router as audit_router
from cgstore.blobs import service as blobs_service
from cgstore.blobs.router import router as blobs_router
from cgstore.claims import service as claims_service
from cgstore.claims.router import router as claims_router
from cgstore.compiled_graphs import events
from cgstore.compiled_graphs.router import repo_router as compiled_graphs_router
from cgstore.compiled_graphs.router import resolve_router as compiled_graphs_resolve_router
from cgstore.console.router import ConsoleHeaders, error_page
from cgstore.console.router import router as console_router
from cgstore.context import StoreContext
from cgstore.core.cursors import CursorSeal
from cgstore.core.db import Database
from cgstore.core.feeds import HeadWatch
from cgstore.core.http import ERROR_RESPONSES, install_error_handlers, install_request_schemas
from cgstore.core.inputs import refuse_unstorable_parameters
from cgstore.core.metrics import Metrics, MetricsMiddleware
from cgstore.core.private import private_dir
from cgstore.core.serving import freeze_startup_heap, thaw_heap
from cgstore.core.urls import install_slash_redirects
from cgstore.health.router import router as health_router
from cgstore.mirror import follower
from cgstore.mirror.flight import MirrorRuntime
from cgstore.mirror.guard import refuse_writes_on_mirror
from cgstore.operations import checkpoints, gc, leases, scrub
from cgstore.operations import service as operations
from cgstore.owners.router import router as owners_router
from cgstore.repos.router import router as repos_router
from cgstore.settings import Settings
from cgstore.storage import open_storage
from cgstore.tokens.router import router as tokens_router
from cgstore.tokens.service import TokenService

log = logging.getLogger(__name__)


def build_context(settings: Settings) -> StoreContext:
    private_dir(settings.home)
    db = Database(settings.resolved_database_url)
    tokens = TokenService(db, settings)
    ctx = StoreContext(
        settings=settings,
        db=db,
        storage=open_storage(settings),
        tokens=tokens,
        metrics=Metrics(settings.metrics_family_labels),
        denials=DenialLog(db, settings.audit_interval_s, settings.audit_max_sources),
        cursors=CursorSeal(tokens.ring.derive("listing-cursors")),
        feed=HeadWatch(
            lambda: events.head_of(db), poll_s=settings.events_poll_s, max_waiters=settings.events_max_waiters
        ),
        mirror=MirrorRuntime.from_settings(settings),
    )
    ctx.metrics.watch_upstream(lambda: _upstream_up(ctx))
    ctx.metrics.watch_upload_sessions(lambda: _open_sessions_or_nan(ctx))
    ctx.metrics.watch_claims(lambda: _claims_in_flight_or_nan(ctx))
    if ctx.mirror is not None:
        ctx.metrics.watch_mirror_lag(lambda: _mirror_lag_or_nan(ctx))
    return ctx


def _mirror_lag_or_nan(ctx: StoreContext) -> float:
    try:
        return follower.sync_lag_s(ctx)
    except Exception:  # as for upload sessions: "unknown" during a database outage
        return float("nan")


def _upstream_up(ctx: StoreContext) -> float:
    reachable = ctx.mirror.reachable if ctx.mirror is not None else None
    return float("nan") if reachable is None else float(reachable)


def _open_sessions_or_nan(ctx: StoreContext) -> float:
    try:
        return float(blobs_service.open_session_count(ctx))
    except Exception:  # a scrape during a database outage reports "unknown", not an error
        return float("nan")


def _claims_in_flight_or_nan(ctx: StoreContext) -> float:
    try:
        return float(claims_service.count_in_flight(ctx.db))
    except Exception:  # as for upload sessions: "unknown" during a database outage
        return float("nan")


def _background_tasks(ctx: StoreContext) -> list[asyncio.Task]:
    """The periodic tasks, each under its lease (one replica at a time runs each); the scrub only when asked."""
    periodic = [
        (leases.UPLOAD_REAPER, ctx.settings.reaper_interval_s, operations.reap_sessions),
        (leases.GC, ctx.settings.gc_interval_s, gc.collect_garbage),
        (leases.SCRUB, ctx.settings.scrub_interval_s, scrub.scrub_round),
        (leases.AUDIT_CHECKPOINT, ctx.settings.audit_checkpoint_interval_s, checkpoints.checkpoint_round),
    ]
    tasks = [
        asyncio.create_task(operations.run_periodically(ctx, name, interval_s, task))
        for name, interval_s, task in periodic
        if interval_s > 0
    ]
    if ctx.mirror is not None:  # a mirror follows its upstream's events feed (one replica, under a lease)
        tasks.append(asyncio.create_task(follower.follow_forever(ctx)))
    return tasks


async def _flush_denials(ctx: StoreContext) -> None:
    """The last 401s counted and hidden misses deferred before shutdown go to the audit log too."""
    try:
        await run_in_threadpool(ctx.denials.flush)
    except Exception:  # the database is gone at shutdown: say how many were lost
        log.exception("could not write %d pending denials to the audit log", ctx.denials.pending)


_REPO = "/v1/repos/{owner}/{repo}"
_SAME_REPO = {"owner": "$request.path.owner", "repo": "$request.path.repo"}
#: OpenAPI links: which answer feeds which next call, as a client chains them (and as
#: schemathesis' stateful fuzzing follows them, so a created thing is then used).
#: (producer method, path, its statuses) -> [(consumer method, path, its parameters)].
OPENAPI_LINKS: dict[tuple[str, str, tuple[str, ...]], list[tuple[str, str, dict[str, str]]]] = {
    ("post", "/v1/owners", ("201",)): [("put", _REPO, {"owner": "$response.body#/slug"})],
    ("put", _REPO, ("200", "201")): [
        (method, _REPO + path, {"owner": "$response.body#/owner", "repo": "$response.body#/name"})
        for method, path in (
            ("post", "/uploads"),
            ("get", "/compiled-graphs"),
            ("post", "/preflight"),
            ("post", "/blobs:missing"),
            ("put", "/compiled-graphs/{key}"),
            ("post", "/compiled-graphs:claim"),
        )
    ],
    ("post", _REPO + "/compiled-graphs:claim", ("201",)): [
        (method, _REPO + path, {**_SAME_REPO, "claim": "$response.body#/claim"})
        for method, path in (
            ("post", "/compiled-graphs/claims/{claim}:heartbeat"),
            ("post", "/compiled-graphs/claims/{claim}:release"),
        )
    ],
    ("post", _REPO + "/uploads", ("202",)): [
        (method, _REPO + "/uploads/{session_id}", {**_SAME_REPO, "session_id": "$response.header.Upload-Id"})
        for method in ("patch", "get", "put", "delete")
    ],
    ("put", _REPO + "/uploads/{session_id}", ("201",)): [
        (method, _REPO + "/blobs/{digest}", {**_SAME_REPO, "digest": "$request.query.digest"})
        for method in ("head", "get")
    ],
    ("put", _REPO + "/blobs/{digest}", ("201",)): [
        (method, _REPO + "/blobs/{digest}", {**_SAME_REPO, "digest": "$request.path.digest"})
        for method in ("head", "get")
    ],
    ("put", _REPO + "/compiled-graphs/{key}", ("200", "201")): [
        (method, _REPO + path, {**_SAME_REPO, "key": "$request.path.key"})
        for method, path in (("get", "/compiled-graphs/{key}"), ("post", "/compiled-graphs/{key}:yank"))
    ],
    ("post", "/v1/tokens", ("201",)): [("delete", "/v1/tokens/{jti}", {"jti": "$response.body#/jti"})],
}


def install_links(app: FastAPI) -> None:
    """Add ``OPENAPI_LINKS`` to the served schema (a renamed route fails here, at the first build)."""
    build = app.openapi

    def openapi() -> dict:
        schema = build()
        paths = schema["paths"]
        for (method, path, statuses), consumers in OPENAPI_LINKS.items():
            targets = [(paths[target][verb]["operationId"], parameters) for verb, target, parameters in consumers]
            links = {name: {"operationId": name, "parameters": parameters} for name, parameters in targets}
            for status in statuses:
                paths[path][method]["responses"][status]["links"] = links
        return schema

    app.openapi = openapi


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    ctx = build_context(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The pool every database and storage call runs in (per event loop).
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.worker_threads
        tasks = [
            *_background_tasks(ctx),
            asyncio.create_task(ctx.denials.flush_forever()),
            asyncio.create_task(ctx.feed.run()),
        ]
        freeze_startup_heap()
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await run_in_threadpool(operations.release_all, ctx)
            await _flush_denials(ctx)
            ctx.db.dispose()
            if ctx.mirror is not None:
                ctx.mirror.upstream.close()
            thaw_heap()

    # /docs serves Swagger UI 5 (OpenAPI 3.1) from the store itself: GPU clusters are often
    # air-gapped, and FastAPI's default page loads it from a CDN. ReDoc is not served.
    app = FastAPIOffline(
        title="cgstore",
        version=__version__,
        lifespan=lifespan,
        responses=ERROR_RESPONSES,
        redoc_url=None,
        static_url="/docs-static",
        # The one input rule for query text (core/inputs.py), checked before any route's own work.
        dependencies=[Depends(refuse_unstorable_parameters)],
    )
    app.state.context = ctx
    install_error_handlers(app, on_denial=audit_denial, as_page=error_page)
    app.add_middleware(MetricsMiddleware, metrics=ctx.metrics)
    # Outermost: the console's security headers reach every answer under /console, a last-resort 500 included.
    app.add_middleware(ConsoleHeaders)
    # Each router carries its prefix: with FastAPI 0.165 a prefix given here would
    # leave route.path relative, and metrics and the audit label requests by it.
    for router in (
        health_router,
        tokens_router,
        owners_router,
        repos_router,
        blobs_router,
        audit_router,
        claims_router,
        compiled_graphs_router,
        compiled_graphs_resolve_router,
        admin_router,
        console_router,
    ):
        writes = router in (owners_router, repos_router, blobs_router, claims_router, compiled_graphs_router)
        app.include_router(router, dependencies=[Depends(refuse_writes_on_mirror)] if writes else [])
    install_slash_redirects(app, settings.public_url)
    install_request_schemas(app)
    install_links(app)
    return app
