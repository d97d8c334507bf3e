"""Waking long-polls when a feed's head moves, without a thread or a database connection per waiter.

A long-poll (``GET /v1/compiled-graphs:events?wait=S``) must answer as soon as
something it may see is appended, yet must not hold a server thread or a
database connection while it waits: a fleet of thousands of workers each keeps
one open. So each process has one ``HeadWatch``. Waiters are coroutines that
``await`` it; it wakes them all when the feed's head moves, and each then reads
its own visible events (in a short threadpool call) and waits again if there
are none. Whether the head moved is learned two ways:

- this process's own appends call ``notify_threadsafe`` after their commit:
  woken at once;
- other replicas' appends are seen by polling the head (``head()``, one
  indexed read) every ``poll_s`` while anyone waits: one read per process,
  however many waiters, and none at all while nobody waits.

A wake says only "something was appended"; it is never an answer. What a
waiter may see is decided by its own read, so a wake by events it cannot see
costs it one empty read and it keeps waiting (``compiled_graphs/events.py``).

No wake is lost: a waiter takes its ``ticket`` (the current generation)
*before* its read, and ``wait(ticket)`` returns at once if the head moved
since. A move noticed by the poll after the read wakes the ticket; one noticed
before it was committed before, so the read saw it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.concurrency import run_in_threadpool

from cgstore.core.errors import TooManyWaiters

log = logging.getLogger(__name__)


class HeadWatch:
    """One per process: wakes the waiting long-polls of a feed whose head is ``head()`` (an int)."""

    def __init__(self, head: Callable[[], int], *, poll_s: float, max_waiters: int) -> None:
        self._head = head
        self._poll_s = poll_s
        self._max_waiters = max_waiters
        self._waiters = 0
        self._seen: int | None = None
        self._moved = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def waiters(self) -> int:
        return self._waiters

    @contextlib.asynccontextmanager
    async def waiting(self) -> AsyncIterator[None]:
        """One long-poll's place among the waiters; past ``max_waiters``: ``TooManyWaiters``."""
        if self._waiters >= self._max_waiters:
            raise TooManyWaiters(
                "too many long-polls of the events feed are waiting on this store process; retry in a moment",
                max_waiters=self._max_waiters,
            )
        self._waiters += 1
        try:
            yield
        finally:
            self._waiters -= 1

    def ticket(self) -> asyncio.Event:
        """The current generation: take it before reading, then ``wait`` on it."""
        return self._moved

    async def wait(
        self, ticket: asyncio.Event, timeout_s: float, gone: Callable[[], Awaitable[object]] | None = None
    ) -> bool:
        """Until the head moved since ``ticket`` was taken (True), or ``timeout_s`` passed or ``gone()``
        returned (False: the client hung up; its place among the waiters is given back at once)."""
        if timeout_s <= 0:
            return ticket.is_set()
        moved = asyncio.ensure_future(ticket.wait())
        watches = [moved] if gone is None else [moved, asyncio.ensure_future(gone())]
        try:
            await asyncio.wait(watches, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for watch in watches:
                watch.cancel()
        return ticket.is_set()

    def _wake(self) -> None:
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()

    def notify_threadsafe(self) -> None:
        """The head moved by this process's own commit (from any thread): wake the waiters now."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # not serving (a CLI yank): other processes' polls notice it
        with contextlib.suppress(RuntimeError):  # the loop closed between the check and the call
            loop.call_soon_threadsafe(self._wake)

    async def run(self) -> None:
        """The poll, for the life of the app: read the head every ``poll_s`` while anyone waits."""
        self._loop = asyncio.get_running_loop()
        self._moved = asyncio.Event()  # bound to this loop (an app served again runs in a new one)
        try:
            while True:
                if self._waiters:
                    await self._poll_once()
                await asyncio.sleep(self._poll_s)
        finally:
            self._loop = None
            self._wake()  # nobody waits for a poll that stopped

    async def _poll_once(self) -> None:
        try:
            head = await run_in_threadpool(self._head)
        except Exception:  # a database outage: waiters run out their wait; the next poll tries again
            log.warning("events feed: could not read the head", exc_info=True)
            return
        if head != self._seen:
            self._seen = head
            self._wake()
