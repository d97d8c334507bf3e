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
refuses as too old (400 with ``detail.expired``: the outage outlasted the
upstream's ``CGSTORE_EVENTS_RETENTION_S``) is replaced by a resync: take a
fresh cursor at the upstream's head first, then re-check every live mirrored
record against the upstream and yank those it no longer serves; events after
the fresh cursor are read next, so nothing falls in between.

An unreachable upstream is retried with a capped backoff (1 s doubling to
``_MAX_BACKOFF_S``); the mirror keeps serving what it holds meanwhile
(``mirror.service``), and the lag (``cgstore_mirror_sync_lag_seconds``, the
console's Storage page) grows until the feed answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging

from starlette.concurrency import run_in_threadpool

from cgstore.compiled_graphs import events
from cgstore.context import StoreContext
from cgstore.core.db import utcnow
from cgstore.mirror import service, upstream
from cgstore.operations import leases
from cgstore.operations.leases import HeldLease, LeaseLost
from cgstore_client.wire.fleet import MAX_EVENTS_PAGE, EventsAnswer, RecordEvent

log = logging.getLogger(__name__)

#: ``mirror_state`` keys this module owns.
CURSOR = "feed_cursor"
SYNCED_AT = "feed_synced_at"
POLLING_SINCE = "feed_polling_since"
#: Longest pause between attempts while the upstream is unreachable.
_MAX_BACKOFF_S = 10.0
#: Preheat pulls running at once (each pull is itself parallel and single-flight).
_PREHEAT_CONCURRENCY = 4
#: Seconds added to the long-poll's wait for the upstream's answer to arrive.
_ANSWER_SLACK_S = 10.0


class Follower:
    """The state of one replica's follower: what it holds in memory beyond ``mirror_state``."""

    def __init__(self, ctx: StoreContext) -> None:
        self.ctx = ctx
        self.preheating: set[tuple[str, str, str]] = set()
        self.preheat_tasks: set[asyncio.Task] = set()
        self.preheat_slots = asyncio.Semaphore(_PREHEAT_CONCURRENCY)
        #: Whether the last answer emptied the upstream's feed (the next long-poll waits in sync).
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
                if lease is None:  # another replica follows; check again before its lease could lapse
                    await asyncio.sleep(min(5.0, ctx.settings.lease_ttl_s / 3))
                    continue
                try:
                    await self.round(lease)
                    backoff = 1.0
                except LeaseLost:
                    log.warning("lost the %s lease; its new holder follows the upstream", leases.MIRROR_FOLLOW)
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # an outage must not kill the loop: retry, backing off
                    log.warning(
                        "following the upstream's events feed failed (%s); again in %.0f s", _why(error), backoff
                    )
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _MAX_BACKOFF_S)
        finally:
            for task in self.preheat_tasks:
                task.cancel()

    async def round(self, lease: HeldLease) -> None:
        """One long-poll of the upstream's feed and its events applied; the cursor saved after them."""
        ctx = self.ctx
        cursor = await run_in_threadpool(service.state_get, ctx, CURSOR)
        if cursor is None:
            # The first contact: start at the upstream's head (what was published before is pulled on demand).
            cursor = events.SINCE_NOW
        if self.caught_up:
            await run_in_threadpool(service.state_put, ctx, POLLING_SINCE, utcnow().isoformat())
        try:
            answer = await self.poll(cursor)
        except upstream.CursorExpired:
            await self.resync(lease)
            return
        except BaseException:
            self.caught_up = False
            with contextlib.suppress(Exception):
                await run_in_threadpool(service.state_put, ctx, POLLING_SINCE, None)
            raise
        await self.apply(answer.events)
        self.caught_up = _caught_up(answer)
        await run_in_threadpool(self.save, lease, answer, utcnow() if self.caught_up else None)

    async def poll(self, since: str) -> EventsAnswer:
        """One long-poll of the upstream's feed (bounded: the wait plus a slack)."""
        wait = self.ctx.settings.mirror_follow_wait_s
        client = service.upstream_client(self.ctx)
        return await asyncio.wait_for(
            run_in_threadpool(client.events, since, wait), timeout=wait + _ANSWER_SLACK_S + client.timeout_s
        )

    def save(self, lease: HeldLease, answer: EventsAnswer, synced_at: dt.datetime | None) -> None:
        """Renew the lease (``LeaseLost`` if another replica follows now), then save the cursor (and sync time)."""
        lease.renew()
        service.state_put(self.ctx, CURSOR, answer.next)
        if synced_at is not None:
            service.state_put(self.ctx, SYNCED_AT, synced_at.isoformat())

    async def apply(self, page: list[RecordEvent]) -> None:
        """Apply a page of upstream events, in order (yanks at once; preheats started in the background)."""
        for event in page:
            owner, _, repo = event.repo.partition("/")
            if event.kind == events.YANKED:
                await run_in_threadpool(service.apply_yank, self.ctx, owner, repo, event.key, event.reason or "")
            elif event.kind == events.PUBLISHED:
                await run_in_threadpool(service.forget_miss, self.ctx, owner, repo, event.key)
                self.preheat(owner, repo, event)
            self.ctx.metrics.mirror_feed_events.labels(event.kind).inc()

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
            # A record whose platform the filters refuse (``CGSTORE_MIRROR_SM``) is not pulled: no blob crosses.
            self.ctx.metrics.mirror_preheats.labels("pulled" if pulled else "filtered").inc()
        except Exception as error:  # the next worker's resolve pulls it on demand
            self.ctx.metrics.mirror_preheats.labels("failed").inc()
            log.warning("preheating %s/%s %s failed: %s", owner, repo, key, _why(error))
        finally:
            self.preheating.discard(job)

    async def resync(self, lease: HeldLease) -> None:
        """The saved cursor is too old: a fresh one at the upstream's head, then every mirrored record re-checked."""
        ctx = self.ctx
        log.warning("the upstream refused the saved feed cursor as too old: re-checking every mirrored record")
        ctx.metrics.mirror_resyncs.inc()
        fresh = await run_in_threadpool(service.upstream_client(ctx).events, events.SINCE_NOW, 0)
        yanked = await run_in_threadpool(service.recheck_all, ctx, lease.renew)
        if yanked:
            log.warning("resync: %d mirrored records the upstream no longer serves were yanked here", yanked)
        await run_in_threadpool(self.save, lease, fresh, utcnow())


def _caught_up(answer: EventsAnswer) -> bool:
    """A page short of full: the upstream had nothing more when it answered."""
    return len(answer.events) < MAX_EVENTS_PAGE


def sync_lag_s(ctx: StoreContext, now: dt.datetime | None = None) -> float:
    """How far behind the upstream's feed this mirror is (whichever replica follows); NaN before the first contact.

    0 while a long-poll sent after catching up is open (bounded by its wait and
    slack, so a follower that died stops counting as in sync); otherwise the
    seconds since the follower last caught up.
    """
    now = now or utcnow()
    polling = service.state_get(ctx, POLLING_SINCE)
    if polling is not None:
        bound = ctx.settings.mirror_follow_wait_s + _ANSWER_SLACK_S
        if (now - dt.datetime.fromisoformat(polling)).total_seconds() <= bound:
            return 0.0
    synced = service.state_get(ctx, SYNCED_AT)
    if synced is None:
        return float("nan")
    return max(0.0, (now - dt.datetime.fromisoformat(synced)).total_seconds())


def _why(error: BaseException) -> str:
    """An error for a log line: its type and message (never a URL with credentials: the upstream token is a header)."""
    return f"{type(error).__name__}: {error}"


async def follow_forever(ctx: StoreContext) -> None:
    """The lifespan task of a mirror (``app.py``): a ``Follower`` for as long as the store runs."""
    with contextlib.suppress(asyncio.CancelledError):
        await Follower(ctx).run()
