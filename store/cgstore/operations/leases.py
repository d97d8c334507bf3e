"""Leases: at most one store instance runs a given background task at any time.

``acquire`` is one conditional UPDATE — take the row if it is ours already or
has expired — and, when no row exists yet, an INSERT that ignores conflicts. On
PostgreSQL two racing UPDATEs serialize on the row lock and the loser re-reads
the winner's row (no longer expired: zero rows); on SQLite writes serialize on
the database lock. Either way exactly one caller gets the lease. No
PostgreSQL-only advisory lock: the same code runs on both dialects, and a lease
survives a dropped connection (an advisory lock would silently vanish with it).

Expiry is judged by the acquiring instance's clock: replicas' clocks must agree
to well within ``CGSTORE_LEASE_TTL_S`` (NTP does).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import select, update

from cgstore.core.db import Database, insert_ignoring_conflicts, utcnow
from cgstore.operations.models import Lease

#: Lease names of the background tasks (one place, so no two tasks share one by accident).
UPLOAD_REAPER = "upload-reaper"
GC = "gc"
SCRUB = "scrub"
AUDIT_CHECKPOINT = "audit-checkpoint"
MIRROR_FOLLOW = "mirror-follow"


class LeaseLost(RuntimeError):
    """The lease expired and another instance took it: stop the task now. Never reaches HTTP."""


@dataclass
class HeldLease:
    """A lease this instance holds; ``renew`` between units of work keeps it."""

    db: Database
    name: str
    holder: str
    ttl_s: float
    generation: int
    cursor: str | None

    def renew(self, now: dt.datetime | None = None) -> None:
        """Push the expiry forward; ``LeaseLost`` if another instance holds it now."""
        now = now or utcnow()
        with self.db.session() as session:
            renewed = session.execute(
                update(Lease)
                .where(Lease.name == self.name, Lease.holder == self.holder, Lease.generation == self.generation)
                .values(expires_at=now + dt.timedelta(seconds=self.ttl_s))
            ).rowcount
        if not renewed:
            raise LeaseLost(f"lease {self.name!r} was taken over")

    def save_cursor(self, cursor: str | None) -> None:
        """Record progress (and renew); ``LeaseLost`` if the lease is no longer ours."""
        now = utcnow()
        with self.db.session() as session:
            saved = session.execute(
                update(Lease)
                .where(Lease.name == self.name, Lease.holder == self.holder, Lease.generation == self.generation)
                .values(cursor=cursor, expires_at=now + dt.timedelta(seconds=self.ttl_s))
            ).rowcount
        if not saved:
            raise LeaseLost(f"lease {self.name!r} was taken over")
        self.cursor = cursor

    def release(self) -> None:
        """Let the lease lapse now, so another instance need not wait for the expiry."""
        release(self.db, self.holder, self.name)


def acquire(db: Database, name: str, holder: str, ttl_s: float, now: dt.datetime | None = None) -> HeldLease | None:
    """Take (or renew) the lease ``name`` for ``holder``; None when another holder's is unexpired."""
    now = now or utcnow()
    expires_at = now + dt.timedelta(seconds=ttl_s)
    with db.session() as session:
        # Ours already: renew in place, keeping the generation.
        renewed = session.execute(
            update(Lease).where(Lease.name == name, Lease.holder == holder).values(expires_at=expires_at)
        ).rowcount
        if not renewed:
            # Expired, someone else's: take it over (a new generation).
            renewed = session.execute(
                update(Lease)
                .where(Lease.name == name, Lease.expires_at <= now)
                .values(holder=holder, expires_at=expires_at, acquired_at=now, generation=Lease.generation + 1)
            ).rowcount
        if not renewed and not insert_ignoring_conflicts(
            session, Lease, name=name, holder=holder, expires_at=expires_at, acquired_at=now, generation=1
        ):
            return None
        row = session.get(Lease, name)
        if row is None or row.holder != holder:
            return None
        return HeldLease(db, name, holder, ttl_s, row.generation, row.cursor)


def saved_cursor(db: Database, name: str) -> str | None:
    """The cursor the lease ``name`` carries (where its task's next run starts), without taking it."""
    with db.session() as session:
        row = session.get(Lease, name)
        return row.cursor if row is not None else None


def release(db: Database, holder: str, name: str | None = None) -> int:
    """Let ``holder``'s leases (or just ``name``) lapse now; returns how many it held."""
    with db.session() as session:
        statement = update(Lease).where(Lease.holder == holder)
        if name is not None:
            statement = statement.where(Lease.name == name)
        return session.execute(statement.values(expires_at=utcnow())).rowcount


@dataclass(frozen=True)
class LeaseInfo:
    """A lease row as the console shows it: who runs the task, since when, until when, how far it got."""

    name: str
    holder: str
    acquired_at: dt.datetime
    expires_at: dt.datetime
    generation: int
    cursor: str | None

    def held(self, now: dt.datetime) -> bool:
        return self.expires_at > now


def list_leases(db: Database) -> list[LeaseInfo]:
    """Every lease row (one per background task that ever ran), by name."""
    with db.session() as session:
        return [
            LeaseInfo(row.name, row.holder, row.acquired_at, row.expires_at, row.generation, row.cursor)
            for row in session.scalars(select(Lease).order_by(Lease.name))
        ]
