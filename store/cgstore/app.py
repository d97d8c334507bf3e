"""The app factory: builds the shared resources and mounts every feature's router."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import anyio.to_thread
from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from cgstore import __version__
from cgstore.blobs import service as blobs_service
from cgstore.blobs.router import router as blobs_router
from cgstore.core.context import StoreContext
from cgstore.core.db import Database
from cgstore.core.http import install_error_handlers
from cgstore.core.metrics import Metrics, MetricsMiddleware
from cgstore.core.private import private_dir
from cgstore.health.router import router as health_router
from cgstore.settings import Settings
from cgstore.storage import open_storage
from cgstore.tokens.service import TokenService

log = logging.getLogger(__name__)


def build_context(settings: Settings) -> StoreContext:
    private_dir(settings.home)
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


async def _reap_forever(ctx: StoreContext) -> None:
    """Reclaim abandoned upload sessions every ``reaper_interval_s``."""
    while True:
        await asyncio.sleep(ctx.settings.reaper_interval_s)
        try:
            reaped = await run_in_threadpool(blobs_service.reap_expired_sessions, ctx)
            if reaped:
                log.info("reaped %d expired upload sessions", reaped)
        except Exception:  # an outage must not kill the reaper; it tries again next round
            log.exception("upload session reaper failed")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    ctx = build_context(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The pool every database and storage call runs in (per event loop).
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.worker_threads
        reaper = asyncio.create_task(_reap_forever(ctx))
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            ctx.db.dispose()

    app = FastAPI(title="cgstore", version=__version__, lifespan=lifespan)
    app.state.context = ctx
    install_error_handlers(app)
    app.add_middleware(MetricsMiddleware, metrics=ctx.metrics)
    app.include_router(health_router)
    app.include_router(blobs_router)
    return app
