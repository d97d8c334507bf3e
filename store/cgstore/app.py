"""The app factory: builds the shared resources and mounts every feature's router."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from cgstore import __version__
from cgstore.blobs import service as blobs_service
from cgstore.blobs.router import router as blobs_router
from cgstore.core.context import StoreContext
from cgstore.core.db import Database
from cgstore.core.http import ERROR_RESPONSES, install_error_handlers
from cgstore.core.metrics import Metrics, MetricsMiddleware
from cgstore.health.router import router as health_router
from cgstore.operations import gc, leases
from cgstore.operations import service as operations
from cgstore.settings import Settings
from cgstore.storage import open_storage
from cgstore.tokens.service import TokenService


def build_context(settings: Settings) -> StoreContext:
    db = Database(settings.resolved_database_url)
    ctx = StoreContext(
        settings=settings,
        db=db,
        storage=open_storage(settings),
        tokens=TokenService(db, settings),
        metrics=Metrics(),
    )
    ctx.metrics.watch_upload_sessions(lambda: _open_sessions_or_nan(ctx))
    return ctx


def _open_sessions_or_nan(ctx: StoreContext) -> float:
    try:
        return float(blobs_service.open_session_count(ctx))
    except Exception:  # a scrape during a database outage reports "unknown", not an error
        return float("nan")


def _background_tasks(ctx: StoreContext) -> list[asyncio.Task]:
    """The periodic tasks, each under its lease (one replica at a time runs each)."""
    return [
        asyncio.create_task(
            operations.run_periodically(ctx, leases.UPLOAD_REAPER, ctx.settings.reaper_interval_s, operations.reap_sessions)
        ),
        asyncio.create_task(operations.run_periodically(ctx, leases.GC, ctx.settings.gc_interval_s, gc.collect_garbage)),
    ]


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    ctx = build_context(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = _background_tasks(ctx)
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await run_in_threadpool(operations.release_all, ctx)
            ctx.db.dispose()

    app = FastAPI(title="cgstore", version=__version__, lifespan=lifespan, responses=ERROR_RESPONSES)
    app.state.context = ctx
    install_error_handlers(app)
    app.add_middleware(MetricsMiddleware, metrics=ctx.metrics)
    app.include_router(health_router)
    app.include_router(blobs_router)
    return app
