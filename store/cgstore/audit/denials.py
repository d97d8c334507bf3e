"""Auditing refusals without letting unauthenticated traffic write to the database per request.

A 401 costs its sender nothing but a request, so writing one row per 401
let a flood of bad tokens compete with everyone's writes for the database
(a thousand of them slowed others' small uploads sixfold). Instead, 401s are
counted in memory per (source address, outcome) and written as one row per
interval (``CGSTORE_AUDIT_INTERVAL_S``) with ``count`` = how many there were,
by a background task and once more at shutdown. Every 401 is still
accounted for: the counts of the rows sum to the number of 401s answered.
Memory is bounded: beyond ``CGSTORE_AUDIT_MAX_SOURCES`` distinct keys in one
interval, further sources are counted under the source ``*``.

403s and hidden 404s come from callers holding a valid token (whose own
requests are already bounded by what the token may do); each stays one row,
written at once in its own transaction.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import threading

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from cgstore.audit.models import TARGET_LEN
from cgstore.audit.service import DETAIL_STRING_LEN, record, record_denial
from cgstore.core.db import Database, utcnow
from cgstore.core.errors import StoreError

log = logging.getLogger(__name__)

#: The action of an aggregate row (its requests' paths are in ``detail.paths``).
AGGREGATE_ACTION = "auth"
#: The source under which sources beyond the per-interval bound are counted.
OVERFLOW_SOURCE = "*"
# What one aggregate keeps besides its count: a few distinct messages and paths.
MAX_MESSAGES = 8
MAX_PATHS = 5


@dataclasses.dataclass
class _Aggregate:
    first_at: dt.datetime
    last_at: dt.datetime
    target: str
    count: int = 0
    messages: dict[str, int] = dataclasses.field(default_factory=dict)
    paths: list[str] = dataclasses.field(default_factory=list)

    def add(self, at: dt.datetime, message: str, path: str) -> None:
        self.merge(_Aggregate(at, at, path, 1, {message: 1}, [path]))

    def merge(self, other: _Aggregate) -> None:
        self.count += other.count
        self.first_at, self.last_at = min(self.first_at, other.first_at), max(self.last_at, other.last_at)
        for message, times in other.messages.items():
            if message in self.messages or len(self.messages) < MAX_MESSAGES:
                self.messages[message] = self.messages.get(message, 0) + times
        for path in other.paths:
            if path not in self.paths and len(self.paths) < MAX_PATHS:
                self.paths.append(path)


class DenialLog:
    """The in-memory side of 401 auditing: ``count`` on every 401, ``flush`` every interval."""

    def __init__(self, db: Database, interval_s: float, max_sources: int) -> None:
        self._db = db
        self.interval_s = interval_s
        self._max_sources = max_sources
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], _Aggregate] = {}

    def count(self, *, source: str, outcome: str, message: str, path: str) -> None:
        """Account for one 401. No I/O: called on the event loop for every refused request."""
        now = utcnow()
        # Memory per key stays bounded whatever the request: only a prefix one
        # longer than the column is kept, so the stored sample still says "cut".
        message, path = message[: DETAIL_STRING_LEN + 1], path[: TARGET_LEN + 1]
        with self._lock:
            key = (source, outcome)
            if key not in self._pending and len(self._pending) >= self._max_sources:
                key = (OVERFLOW_SOURCE, outcome)
            aggregate = self._pending.get(key)
            if aggregate is None:
                aggregate = self._pending[key] = _Aggregate(now, now, path)
            aggregate.add(now, message, path)

    @property
    def pending(self) -> int:
        """401s counted but not yet written."""
        with self._lock:
            return sum(aggregate.count for aggregate in self._pending.values())

    def flush(self) -> int:
        """Write one row per pending (source, outcome) in one transaction; returns the rows written.

        If the database does not answer, the counts go back into the buffer
        for the next try: a denial is delayed, never lost.
        """
        with self._lock:
            taken, self._pending = self._pending, {}
        if not taken:
            return 0
        try:
            with self._db.session() as session:
                for (source, outcome), aggregate in taken.items():
                    record(
                        session,
                        actor="-",
                        jti=None,
                        action=AGGREGATE_ACTION,
                        target=aggregate.target,
                        outcome=outcome,
                        source=source,
                        count=aggregate.count,
                        at=aggregate.first_at,
                        detail={
                            "aggregated": True,
                            "last_at": aggregate.last_at.isoformat(),
                            "messages": aggregate.messages,
                            "paths": aggregate.paths,
                        },
                    )
        except Exception:
            self._put_back(taken)
            raise
        return len(taken)

    def _put_back(self, taken: dict[tuple[str, str], _Aggregate]) -> None:
        with self._lock:
            for key, aggregate in taken.items():
                current = self._pending.get(key)
                if current is None:
                    self._pending[key] = aggregate
                else:
                    current.merge(aggregate)

    async def flush_forever(self) -> None:
        """The background task: flush every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await run_in_threadpool(self.flush)
            except Exception:  # an outage must not kill the task; the counts wait for the next round
                log.exception("could not write aggregated 401s to the audit log")


async def audit_denial(request: Request, err: StoreError) -> None:
    """The app's denial hook (``install_error_handlers``): 401s are counted, the rest written."""
    context = getattr(request.app.state, "context", None)
    if context is None:
        return
    source = request.client.host if request.client else "-"
    if err.status == 401:
        context.denials.count(source=source, outcome=err.code, message=err.message, path=request.url.path)
        return
    route = getattr(request.scope.get("route"), "path", None)
    claims = getattr(request.state, "claims", None)
    await run_in_threadpool(
        record_denial,
        context.db,
        actor=claims.sub if claims else "-",
        jti=claims.jti if claims else None,
        action=f"{request.method} {route or request.url.path}",
        target=request.url.path,
        repo=_repo_of(request),
        outcome=err.code,
        source=source,
        detail={"message": err.message},
    )


def _repo_of(request: Request) -> str | None:
    owner, repo = request.path_params.get("owner"), request.path_params.get("repo")
    return f"{owner}/{repo}" if owner and repo else None
