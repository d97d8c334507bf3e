"""Background tasks under leases: each runs on one replica at a time, and a dead holder's lapses.

A round of a task first takes (or renews) its lease; an instance that does not
get it skips the round. The holder keeps the lease across rounds (renewed by
each round and by the task between units of work), so the task stays on one
replica while it lives; when that replica dies, the lease expires after
``CGSTORE_LEASE_TTL_S`` and the next round elsewhere takes it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from starlette.concurrency import run_in_threadpool

from cgstore.blobs import service as blobs_service
from cgstore.context import StoreContext
from cgstore.operations import leases
from cgstore.operations.leases import HeldLease, LeaseLost

log = logging.getLogger(__name__)

Task = Callable[[StoreContext, HeldLease], int]


def run_exclusively(ctx: StoreContext, name: str, task: Task) -> int | None:
    """Run ``task`` if this instance gets the lease ``name``; None when another holds it."""
    lease = leases.acquire(ctx.db, name, ctx.instance, ctx.settings.lease_ttl_s)
    if lease is None:
        return None
    try:
        return task(ctx, lease)
    except LeaseLost:
        log.warning("lost the %s lease mid-task; its new holder carries on", name)
        return None


async def run_periodically(ctx: StoreContext, name: str, interval_s: float, task: Task) -> None:
    """Every ``interval_s``, one round of ``task`` under its lease; outages are retried next round."""
    rounds = ctx.metrics.background_rounds
    while True:
        await asyncio.sleep(interval_s)
        try:
            done = await run_in_threadpool(run_exclusively, ctx, name, task)
        except Exception:  # an outage must not kill the loop; it tries again next round
            log.exception("background task %s failed", name)
            rounds.labels(name, "failed").inc()
            continue
        rounds.labels(name, "skipped" if done is None else "ran").inc()
        if done:
            log.info("%s: %d done", name, done)


def reap_sessions(ctx: StoreContext, lease: HeldLease) -> int:
    """The upload-session reaper's round (renewing its lease between sessions)."""
    return blobs_service.reap_expired_sessions(ctx, heartbeat=lease.renew)


def run_once(ctx: StoreContext, name: str, task: Task) -> int | None:
    """One round now (the CLI), then let the lease go so the servers' rounds go on at once."""
    try:
        return run_exclusively(ctx, name, task)
    finally:
        leases.release(ctx.db, ctx.instance, name)


def release_all(ctx: StoreContext) -> None:
    """On shutdown: let this instance's leases lapse now rather than at their expiry."""
    try:
        leases.release(ctx.db, ctx.instance)
    except Exception:  # the database may be the reason we stop; the leases expire anyway
        log.warning("could not release leases at shutdown", exc_info=True)
