"""The record events feed: what was published and yanked, in commit order, as each reader may see it.

Writing: ``published`` and ``yanked`` append one ``CompiledGraphEvent`` in the
caller's transaction (the publish's, the yank's), after its audit entry, so
the record and its event commit or roll back together. Each event's id is the
head plus one, taken under a lock held until commit (PostgreSQL: a
transaction advisory lock; SQLite: the database's write lock, which the
transaction already holds): ids are gapless and in commit order, and a reader
who has seen id N has seen every event before it. After the commit the
process's ``HeadWatch`` (``core/feeds.py``) wakes its long-polls.

Reading (``GET /v1/compiled-graphs:events``): the events after the reader's
position, of the records the token may read — the repos its resolve and
discover search (``access.search_candidates`` / ``searched_repos`` /
``readable_in``), in a private cache only the reader's own — optionally of one
family, at most ``MAX_EVENTS_PAGE``. ``next`` is the position sealed to the
reader (``core.cursors``, scope ``record-events:<principal>``): opaque, and
another principal's cursor, or a forged one, is 400 ``BAD_REQUEST``. Past an
empty answer the position moves to the head read, so events the reader cannot
see are skipped once and never re-read.

Long-polling (``follow``): read; if nothing visible, wait on the ``HeadWatch``
without a thread or a connection, then read again, until an event the reader
may see arrives or ``wait`` runs out. A wake by events the reader cannot see
costs one empty read and does not end the wait, so another tenant's private
publishes are told neither by content, count nor timing.

Retention: the GC task trims events older than ``CGSTORE_EVENTS_RETENTION_S``
(``trim``), always keeping the newest, so the head never goes back. Ids being
gapless, a position below the oldest kept id minus one lost events: 400
``BAD_REQUEST`` with ``detail.expired`` (start again at ``since=now`` and
discover what is live). A position past the head (a registry restored from an
older backup) is answered the same way.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sqlalchemy import delete, event, func, select, text
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from cgstore import access
from cgstore.compiled_graphs import admission
from cgstore.compiled_graphs.models import CompiledGraph, CompiledGraphEvent
from cgstore.context import StoreContext
from cgstore.core.db import Database, plan_without_values, utcnow
from cgstore.core.errors import BadRequest
from cgstore.core.feeds import HeadWatch
from cgstore.repos.models import Repo
from cgstore.tokens.claims import Claims
from cgstore_client.wire.fleet import MAX_EVENTS_PAGE, EventsAnswer, RecordEvent

PUBLISHED, YANKED = "published", "yanked"
#: ``since`` for "from the head on".
SINCE_NOW = "now"
#: The PostgreSQL transaction advisory lock appends take (any constant no other lock uses): "rec-evts".
_APPEND_LOCK = 0x7265632D65767473


# -- writing ------------------------------------------------------------------------------------


def published(session: Session, feed: HeadWatch | None, repo: Repo, row: CompiledGraph) -> None:
    """Tell of ``row``'s publish in this transaction; call it last (after the audit entry)."""
    _append(
        session,
        feed,
        kind=PUBLISHED,
        repo_id=repo.id,
        publisher=row.publisher,
        family=row.family,
        key=row.key,
        discovery_digest=row.discovery_digest,
        binding_signature=row.binding_signature,
        release=row.release,
    )


def yanked(session: Session, feed: HeadWatch | None, repo: Repo, row: CompiledGraph, reason: str) -> None:
    """Tell of ``row``'s yank in this transaction; call it last (after the audit entry)."""
    _append(
        session,
        feed,
        kind=YANKED,
        repo_id=repo.id,
        publisher=row.publisher,
        family=row.family,
        key=row.key,
        reason=reason,
    )


def _append(session: Session, feed: HeadWatch | None, **values) -> None:
    """Insert the event as the head plus one, under the append lock (held until this transaction ends).

    The audit entry the caller wrote before already serializes publishes and
    yanks (``audit.chain``), but the feed's order must not depend on who calls
    it after what: the lock is the feed's own. Callers take it last, so no
    lock is ever taken in the other order.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:lock)"), {"lock": _APPEND_LOCK})
    session.add(CompiledGraphEvent(id=head(session) + 1, at=utcnow(), **values))
    session.flush()
    if feed is not None:
        # Woken after the commit, never before it: a waiter woken earlier would read nothing new.
        event.listen(session, "after_commit", lambda _session: feed.notify_threadsafe(), once=True)


#: The newest event's id (0 before the first): one step down the primary key's index.
_HEAD = select(func.coalesce(func.max(CompiledGraphEvent.id), 0))


def head(session: Session) -> int:
    """The newest event's id (0 before the first)."""
    return session.scalar(_HEAD)


def head_of(db: Database) -> int:
    """The head in one autocommit statement (the ``HeadWatch``'s poll: no BEGIN and COMMIT round trips)."""
    with db.reading() as conn:
        return conn.execute(_HEAD).scalar_one()


def trim(ctx: StoreContext, now: dt.datetime | None = None) -> int:
    """Delete events older than the retention horizon, keeping the newest; how many went (the GC task)."""
    cutoff = (now or utcnow()) - dt.timedelta(seconds=ctx.settings.events_retention_s)
    with ctx.db.session() as session:
        newest = head(session)
        result = session.execute(
            delete(CompiledGraphEvent).where(CompiledGraphEvent.at < cutoff, CompiledGraphEvent.id < newest)
        )
        return result.rowcount or 0


# -- reading ------------------------------------------------------------------------------------


def cursor_scope(claims: Claims) -> str:
    """What a feed cursor is sealed to: its reader (the principal, whatever token it presents)."""
    return f"record-events:{claims.sub}"


def start(ctx: StoreContext, claims: Claims, since: str | None, family: str | None) -> int:
    """The position a request reads after: the head for ``now`` (or none), else the cursor's; checked."""
    if family is not None:
        admission.check_family(family)
    if since is None or since == SINCE_NOW:
        with ctx.db.session() as session:
            return head(session)
    return ctx.cursors.open(cursor_scope(claims), since)


@dataclass(frozen=True)
class Page:
    """Events read after a position, and the position the next read starts after."""

    events: list[RecordEvent]
    position: int


def read(ctx: StoreContext, claims: Claims, family: str | None, position: int) -> Page:
    """The events after ``position`` the caller may read, oldest first, at most ``MAX_EVENTS_PAGE``.

    The head is read first and bounds the page, so an event committed during
    the read is left for the next one (never skipped). The next position is
    the last event's on a full page, else the head: what the caller may not
    see is passed over once.
    """
    with ctx.db.session() as session:
        newest = head(session)
        if position > newest:
            raise _expired("the cursor is ahead of this store's events feed (was the registry restored?)")
        plan_without_values(session)
        searched = access.searched_repos(claims, session.connection().execute(access.search_candidates(claims)))
        rows = _visible_rows(session, searched, family, position, newest) if searched else []
        # After the rows: a trim that ran before them shows here (a conservative "expired", never a gap).
        oldest = session.scalar(select(func.min(CompiledGraphEvent.id)))
        if oldest is not None and position < oldest - 1:
            raise _expired("the cursor is older than the events this store keeps (CGSTORE_EVENTS_RETENTION_S)")
    repos = {repo.id: f"{repo.owner}/{repo.name}" for repo in searched}
    events = [_event(row, repos[row.repo_id]) for row in rows]
    return Page(events, rows[-1].id if len(rows) == MAX_EVENTS_PAGE else newest)


def _visible_rows(
    session: Session, searched: list[access.SearchedRepo], family: str | None, position: int, newest: int
) -> list[CompiledGraphEvent]:
    """The events in ``(position, newest]`` of the searched repos (a private cache's: the reader's own)."""
    query = select(CompiledGraphEvent).where(
        CompiledGraphEvent.id > position,
        CompiledGraphEvent.id <= newest,
        access.readable_in(searched, CompiledGraphEvent.repo_id, CompiledGraphEvent.publisher),
    )
    if family is not None:
        query = query.where(CompiledGraphEvent.family == family)
    return list(session.scalars(query.order_by(CompiledGraphEvent.id).limit(MAX_EVENTS_PAGE)))


def _event(row: CompiledGraphEvent, repo: str) -> RecordEvent:
    return RecordEvent(
        kind=row.kind,
        key=row.key,
        repo=repo,
        family=row.family,
        discovery_digest=row.discovery_digest,
        binding_signature=row.binding_signature,
        release=row.release,
        reason=row.reason,
        at=row.at,
    )


def _expired(message: str) -> BadRequest:
    return BadRequest(message + ": start again with since=now and discover what is live", expired=True)


async def follow(
    ctx: StoreContext,
    claims: Claims,
    *,
    family: str | None,
    since: str | None,
    wait_s: float,
    gone: Callable[[], Awaitable[object]] | None = None,
) -> EventsAnswer:
    """The events after ``since`` the caller may read; with none, wait up to ``wait_s`` for one to arrive.

    Parameters are checked (and the cursor opened) before anything waits; an
    answer ready at once takes no place among the process's waiters. The wait
    holds no thread and no database connection: each read is one short
    threadpool call, and it ends only on an event the caller may see, at the
    deadline, or when ``gone()`` returns (the client hung up: nobody reads the
    answer, and its place is given back without waiting out the deadline).
    """
    position = await run_in_threadpool(start, ctx, claims, since, family)
    deadline = time.monotonic() + min(wait_s, ctx.settings.events_max_wait_s)
    ticket = ctx.feed.ticket()  # before the read: a move during it is not lost
    page = await run_in_threadpool(read, ctx, claims, family, position)
    if page.events or time.monotonic() >= deadline:
        return _answer(ctx, claims, page)
    async with ctx.feed.waiting():
        while not page.events:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await ctx.feed.wait(ticket, remaining, gone):
                break
            ticket = ctx.feed.ticket()
            page = await run_in_threadpool(read, ctx, claims, family, page.position)
    return _answer(ctx, claims, page)


def _answer(ctx: StoreContext, claims: Claims, page: Page) -> EventsAnswer:
    return EventsAnswer(events=page.events, next=ctx.cursors.seal(cursor_scope(claims), page.position))
