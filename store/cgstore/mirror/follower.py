"""The mirror's follower: the upstream's record events feed, applied here, so no yank is ever missed.

One replica follows (the ``mirror-follow`` lease, renewed on every answer):
it long-polls the upstream's ``GET /v1/compiled-graphs:events`` with
``wait = CGSTORE_MIRROR_FOLLOW_WAIT_S`` and, for each event, in order:

- ``yanked``: the local copy, if this mirror holds one, is yanked
  (``service.apply_yank``), which writes the mirror's own record event, so its
  workers' watchers (``GET /v1/compiled-graphs:events`` on the mirror) learn
  of it from their mirror. The upstream answers a long-poll as soon as the
  yank commits, so it is applied within the wait + 1 s;
- ``published``: with ``CGSTORE_MIRROR_PREHEAT=1`` and the record matching
  the mirror's filters (``service.wanted``), it is pulled now
  (``service.pull_record``: single-flight, verified like a pull on demand),
  in the background so a long pull never delays a yank behind it; any
  remembered miss of its key is forgotten, so a worker that asked before the
  publish finds it on its next resolve.

The feed's cursor is saved in ``mirror_state`` after the page's events were
applied (never before), so a follower that dies mid-page re-applies the page
(yanks and pulls are idempotent) and one that resumes after an outage starts
after the last page it finished: no yank is missed. A cursor the upstream
refuses (400: too old, ``detail.expired``, when the outage outlasted the
upstream's ``CGSTORE_EVENTS_RETENTION_S``; or one it can no longer open, say
after a restore) is replaced by a resync: take a
fresh cursor at the upstream's head first, then re-check every live mirrored
record against the upstream and yank those it no longer serves; events after
the fresh cursor are read next, so nothing falls in between.

An unreachable upstream is retried with a capped backoff (1 s doubling to
``MAX_BACKOFF_S``); the mirror keeps serving what it holds meanwhile
(``mirror.service``), and the lag (``cgstore_mirror_sync_lag_seconds``, the
console's Storage page) grows until the feed answers again. Each answer and
each failure of the feed counts as contact with the upstream
(``MirrorRuntime.answered`` / ``failed``): an idle mirror notices an outage,
and its end, within one long-poll, and shows itself degraded meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from typing import Any

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from cgstore.compiled_graphs import events
from cgstore.context import StoreContext
from cgstore.core.db import Database, utcnow
from cgstore.mirror import service
from cgstore.mirror.models import FEED_CURSOR, MirrorState
from cgstore.mirror.upstream import UpstreamRefused, UpstreamUnavailable
from cgstore.operations import leases
from cgstore.operations.leases import HeldLease, LeaseLost
from cgstore_client.wire.fleet import MAX_EVENTS_PAGE, EventsAnswer, RecordEvent
from cgstore_client.wire.records import Record

log = logging.getLogger(__name__)

#: ``mirror_state`` names this module writes besides ``FEED_CURSOR``: when the follower last caught up with the
#: upstream's feed, and when the long-poll it has open since then was sent (``sync_lag_s``).
SYNCED_AT = "feed_synced_at"
POLLING_SINCE = "feed_polling_since"
#: Longest pause between attempts while the upstream is unreachable.
MAX_BACKOFF_S = 10.0
#: Preheat pulls running at once (each pull is itself parallel and single-flight).
PREHEAT_CONCURRENCY = 4
#: Seconds a long-poll's answer may take past its wait and the upstream timeout before it counts as lost.
ANSWER_SLACK_S = 10.0
#: The most mirrored records one resync re-checks (a registry past it resyncs the oldest; logged).
RESYNC_LIMIT = 100_000
#: The reason an upstream yank is applied with when the upstream no longer has the record at all.
GONE_UPSTREAM = "no longer served by the upstream"


# -- mirror_state -------------------------------------------------------------------------------


def read_state(db: Database, name: str) -> dict[str, Any] | None:
    """One named value of ``mirror_state`` (None when never written)."""
    with db.session() as session:
        row = session.get(MirrorState, name)
        return dict(row.value) if row is not None else None


def write_state(db: Database, name: str, value: dict[str, Any]) -> None:
    """Write one named value (only the lease holder writes the follower's: no racing insert)."""
    with db.session() as session:
        session.merge(MirrorState(name=name, value=value, updated_at=utcnow()))


def saved_cursor(db: Database) -> str | None:
    """Where the follower resumes: the upstream feed's cursor after the last page applied (None: never followed)."""
    value = read_state(db, FEED_CURSOR)
    return value.get("cursor") if value else None


def _at(db: Database, name: str) -> dt.datetime | None:
    value = read_state(db, name)
    return dt.datetime.fromisoformat(value["at"]) if value and value.get("at") else None


def sync_lag_s(ctx: StoreContext, now: dt.datetime | None = None) -> float:
    """How far behind the upstream's feed this mirror is (whichever replica follows); NaN before the first contact.

    0 while a long-poll sent after catching up is open (bounded by its wait,
    the upstream timeout and a slack, so a follower that died stops counting as
    in sync); otherwise the seconds since the follower last caught up.
    """
    now = now or utcnow()
    polling = _at(ctx.db, POLLING_SINCE)
    bound = ctx.settings.mirror_follow_wait_s + ctx.settings.upstream_timeout_s + ANSWER_SLACK_S
    if polling is not None and (now - polling).total_seconds() <= bound:
        return 0.0
    synced = _at(ctx.db, SYNCED_AT)
    if synced is None:
        return float("nan")
    return max(0.0, (now - synced).total_seconds())


# -- following ----------------------------------------------------------------------------------


class Follower:
    """One replica's follower: the lease loop, the preheats in flight, whether the last answer caught up."""

    def __init__(self, ctx: StoreContext) -> None:
        assert ctx.mirror is not None, "only a mirror follows an upstream"
        self.ctx = ctx
        self.upstream = ctx.mirror.upstream
        self.preheating: set[tuple[str, str, str]] = set()
        self.preheat_tasks: set[asyncio.Task] = set()
        self.preheat_slots = asyncio.Semaphore(PREHEAT_CONCURRENCY)
        #: Whether the last answer emptied the upstream's feed (the next long-poll then waits in sync).
        self.caught_up = False

    async def run(self) -> None:
        """Follow for as long as the store runs: take the lease, poll, apply; back off through outages."""
        ctx = self.ctx
        backoff = 1.0
        try:
            while True:
                lease = await run_in_threadpool(
                    leases.acquire, ctx.db, leases.MIRROR_FOLLOW, ctx.instance, ctx.settings.lease_ttl_s
                )
                if lease is None:  # another replica follows; look again well before its lease could lapse
                    await asyncio.sleep(min(5.0, ctx.settings.lease_ttl_s / 3))
                    continue
                try:
                    await self.round(lease)
                    backoff = 1.0
                except LeaseLost:
                    log.warning("lost the %s lease; its new holder follows the upstream", leases.MIRROR_FOLLOW)
                except Exception as error:  # an outage must not end the loop: retry, backing off
                    log.warning(
                        "mirror: following the upstream's feed failed (%s); again in %.0f s", _why(error), backoff
                    )
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
        finally:
            for task in self.preheat_tasks:
                task.cancel()

    async def round(self, lease: HeldLease) -> None:
        """One long-poll of the upstream's feed and its events applied; the cursor saved after them."""
        ctx = self.ctx
        cursor = await run_in_threadpool(saved_cursor, ctx.db)
        if self.caught_up:
            await run_in_threadpool(write_state, ctx.db, POLLING_SINCE, {"at": utcnow().isoformat()})
        try:
            # The first contact (no cursor) starts at the upstream's head: what came before is pulled on demand.
            # (That first poll waits for nothing: the cursor, and the sync time, are saved at once.)
            wait = ctx.settings.mirror_follow_wait_s if cursor is not None else 0
            answer = await self.poll(cursor or events.SINCE_NOW, wait)
        except UpstreamRefused as error:
            if error.status != 400 or cursor is None:
                raise
            # Expired (the outage outlasted the upstream's retention) or not ours any more: resync.
            await self.resync(lease, error)
            return
        except BaseException:
            self.caught_up = False
            with contextlib.suppress(Exception):
                await run_in_threadpool(write_state, ctx.db, POLLING_SINCE, {"at": None})
            raise
        await self.apply(answer.events)
        self.caught_up = len(answer.events) < MAX_EVENTS_PAGE
        await run_in_threadpool(self.save, lease, answer.next, self.caught_up)

    async def poll(self, since: str, wait: int) -> EventsAnswer:
        """One long-poll of the upstream's feed, bounded (the upstream client's timeouts, and a slack on top)."""
        bound = wait + 2 * self.ctx.settings.upstream_timeout_s + ANSWER_SLACK_S
        runtime = self.ctx.mirror
        try:
            document = await asyncio.wait_for(run_in_threadpool(self.upstream.events, since, wait), timeout=bound)
        except (UpstreamUnavailable, TimeoutError) as error:
            runtime.failed(_why(error))  # the mirror shows itself degraded (``/healthz``, metrics, console)
            raise
        runtime.answered()  # and well again as soon as the feed answers
        try:
            return EventsAnswer.model_validate(document)
        except ValidationError:
            raise UpstreamRefused("GET /v1/compiled-graphs:events: not an events answer", 502) from None

    def save(self, lease: HeldLease, cursor: str, caught_up: bool) -> None:
        """Renew the lease (``LeaseLost`` if another replica follows now), then save the cursor (and sync time)."""
        lease.renew()
        write_state(self.ctx.db, FEED_CURSOR, {"cursor": cursor})
        if caught_up:
            write_state(self.ctx.db, SYNCED_AT, {"at": utcnow().isoformat()})

    async def apply(self, page: list[RecordEvent]) -> None:
        """Apply a page of upstream events, in order (yanks at once; preheats started in the background)."""
        ctx = self.ctx
        for event in page:
            owner, _, repo = event.repo.partition("/")
            if event.kind == events.YANKED:
                applied = await run_in_threadpool(service.apply_yank, ctx, owner, repo, event.key, event.reason or "")
                if applied:
                    log.info("mirror: applied the upstream's yank of %s:%s", event.repo, event.key)
            elif event.kind == events.PUBLISHED:
                # A worker that missed before the publish finds it on its next resolve, not after the miss's TTL.
                forget_misses(ctx, owner, repo, event.family, event.key)
                self.preheat(owner, repo, event)
            ctx.metrics.mirror_feed_events.labels(event.kind).inc()

    def preheat(self, owner: str, repo: str, event: RecordEvent) -> None:
        """Pull the announced record in the background, when preheating is on and the filters take it."""
        ctx = self.ctx
        if not ctx.settings.mirror_preheat:
            return
        if not service.wanted(ctx, event.family, None):
            ctx.metrics.mirror_preheats.labels("filtered").inc()
            return
        job = (owner, repo, event.key)
        if job in self.preheating:
            return
        self.preheating.add(job)
        task = asyncio.create_task(self._pull(job))
        self.preheat_tasks.add(task)
        task.add_done_callback(self.preheat_tasks.discard)

    async def _pull(self, job: tuple[str, str, str]) -> None:
        owner, repo, key = job
        try:
            async with self.preheat_slots:
                pulled = await run_in_threadpool(service.pull_record, self.ctx, owner, repo, key)
            # Not pulled: the record's platform is filtered out (``CGSTORE_MIRROR_SM``), or it is gone already.
            self.ctx.metrics.mirror_preheats.labels("pulled" if pulled else "filtered").inc()
        except Exception as error:  # the next worker's resolve pulls it on demand
            self.ctx.metrics.mirror_preheats.labels("failed").inc()
            log.warning("mirror: preheating %s/%s:%s failed: %s", owner, repo, key, _why(error))
        finally:
            self.preheating.discard(job)

    async def resync(self, lease: HeldLease, error: Exception) -> None:
        """The saved cursor was refused: a fresh one at the upstream's head first, then every mirrored record
        re-checked against the upstream (those it no longer serves yanked here); nothing falls in between."""
        ctx = self.ctx
        log.warning("mirror: the upstream refused the saved feed cursor (%s): re-checking every mirrored record", error)
        ctx.metrics.mirror_resyncs.inc()
        fresh = await self.poll(events.SINCE_NOW, 0)
        yanked = await run_in_threadpool(recheck_all, ctx, lease.renew)
        if yanked:
            log.warning("mirror: resync yanked %d mirrored records the upstream no longer serves", yanked)
        # In sync from the fresh cursor on: the next long-poll counts as such (lag 0).
        self.caught_up = True
        await run_in_threadpool(self.save, lease, fresh.next, True)


def recheck_all(ctx: StoreContext, heartbeat=None) -> int:
    """Ask the upstream for every live mirrored record; yank here those it yanked or no longer has. How many."""
    rows = service.mirrored_rows(ctx, RESYNC_LIMIT)
    if len(rows) == RESYNC_LIMIT:
        log.warning("mirror: resync re-checks the oldest %d mirrored records only", RESYNC_LIMIT)
    yanked = 0
    for owner, repo, key in rows:
        reason = yank_reason_upstream(ctx, owner, repo, key)
        if reason is not None and service.apply_yank(ctx, owner, repo, key, reason):
            yanked += 1
        if heartbeat is not None:
            heartbeat()
    return yanked


def yank_reason_upstream(ctx: StoreContext, owner: str, repo: str, key: str) -> str | None:
    """Why the upstream no longer serves ``owner/repo:key`` (its yank's reason, or gone); None while it does."""
    document = ctx.mirror.upstream.record(owner, repo, key)
    if document is None:
        return GONE_UPSTREAM
    try:
        record = Record.model_validate(document)
    except ValidationError:
        return None  # not an answer to act on: the record stays until the upstream says otherwise
    if record.yank is None:
        return None
    return record.yank.reason or "yanked upstream"


def forget_misses(ctx: StoreContext, owner: str, repo: str, family: str, key: str) -> None:
    """Drop the remembered upstream misses of a record just published there (its key, and the record itself)."""
    negatives = ctx.mirror.negatives
    negatives.forget(("key", family, key))
    negatives.forget(("record", owner, repo, key))


def _why(error: BaseException) -> str:
    """An error for a log line: its type and message (the upstream token is a header, never in a message)."""
    return f"{type(error).__name__}: {error}"


async def follow_forever(ctx: StoreContext) -> None:
    """The lifespan task of a mirror (``app.py``): a ``Follower`` for as long as the store runs."""
    with contextlib.suppress(asyncio.CancelledError):
        await Follower(ctx).run()
