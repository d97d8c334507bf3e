"""A mirror's in-process state: single flights, remembered misses, the upstream's reachability and figures.

``SingleFlight``: concurrent callers asking for the same thing (a key, a
declaration, a digest) wait for the one call the first of them makes and share
its outcome, so 8 workers booting the same graph through a cold mirror cost
the upstream one resolve, one record and each blob once. ``NegativeCache``:
what the upstream answered "no such record" for is not asked again for
``CGSTORE_MIRROR_NEGATIVE_TTL_S``. ``MirrorRuntime`` holds them with the
upstream client, one per app (``StoreContext.mirror``); nothing in it is shared
between replicas (they share the database, where a pulled record lands once).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TypeVar

from cgstore.mirror.upstream import Upstream, read_token
from cgstore.settings import Settings

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass
class _Call:
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


class SingleFlight:
    """At most one call per key at a time; callers arriving meanwhile get its result (or its error)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[Hashable, _Call] = {}

    def do(self, key: Hashable, call: Callable[[], T]) -> T:
        with self._lock:
            running = self._calls.get(key)
            if running is None:
                running = self._calls[key] = _Call()
                leader = True
            else:
                leader = False
        if not leader:
            running.done.wait()
            if running.error is not None:
                raise running.error
            return running.result  # type: ignore[return-value]
        try:
            running.result = call()
        except BaseException as err:
            running.error = err
            raise
        finally:
            with self._lock:
                del self._calls[key]
            running.done.set()
        return running.result  # type: ignore[return-value]


class NegativeCache:
    """Keys the upstream had nothing for, each forgotten ``ttl_s`` after it was remembered (bounded in size)."""

    def __init__(self, ttl_s: float, max_entries: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._until: dict[Hashable, float] = {}

    def remember(self, key: Hashable) -> None:
        if self.ttl_s <= 0:
            return
        now = time.monotonic()
        with self._lock:
            if len(self._until) >= self.max_entries:
                self._until = {k: t for k, t in self._until.items() if t > now}
                if len(self._until) >= self.max_entries:
                    self._until.clear()
            self._until[key] = now + self.ttl_s

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            until = self._until.get(key)
            if until is None:
                return False
            if until <= time.monotonic():
                del self._until[key]
                return False
            return True

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._until.pop(key, None)


#: While the upstream is unavailable, a request asks it again at most this often (the others answer at once).
RETRY_WHILE_DOWN_S = 2.0


@dataclass
class MirrorRuntime:
    """One mirror app's upstream client, flights, remembered misses, reachability and figures."""

    upstream: Upstream
    negatives: NegativeCache
    flights: SingleFlight = field(default_factory=SingleFlight)
    #: Whether the last call to the upstream was answered (None: not asked yet).
    reachable: bool | None = None
    #: When the upstream last answered, and when it last failed (epoch seconds), and why.
    last_contact: float | None = None
    last_failure: float | None = None
    last_error: str | None = None
    #: Set when the upstream served a key set no trusted key vouches for (refused): the operator must look.
    alarm: str | None = None
    bytes_pulled: int = 0
    bytes_served: int = 0
    records_pulled: int = 0
    _last_rotation_check: float = float("-inf")
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_settings(cls, settings: Settings) -> MirrorRuntime | None:
        """The runtime of a mirror; None for a store without ``CGSTORE_UPSTREAM_URL``."""
        if settings.upstream_url is None:
            return None
        path = settings.upstream_token_file
        if path is None:
            log.warning("mirror: no CGSTORE_UPSTREAM_TOKEN_FILE: the upstream is read without a token")
        elif os.stat(path).st_mode & 0o077:
            log.warning("mirror: %s is readable by other users than the store's: make it 0600", path)
        upstream = Upstream(settings.upstream_url, read_token(path), settings.upstream_timeout_s)
        return cls(upstream=upstream, negatives=NegativeCache(settings.mirror_negative_ttl_s))

    def answered(self) -> None:
        with self._lock:
            self.reachable, self.last_contact = True, time.time()

    def failed(self, reason: str) -> None:
        with self._lock:
            self.reachable, self.last_failure, self.last_error = False, time.time(), reason[:300]

    def worth_asking(self) -> bool:
        """False while the upstream is down and was asked less than ``RETRY_WHILE_DOWN_S`` ago: answer at once."""
        with self._lock:
            if self.reachable is not False or self.last_failure is None:
                return True
            return time.time() - self.last_failure >= RETRY_WHILE_DOWN_S

    def contact_stale(self, max_age_s: float) -> bool:
        """Nothing heard from the upstream (an answer or a failure) for ``max_age_s``."""
        with self._lock:
            last = max(self.last_contact or 0.0, self.last_failure or 0.0)
        return time.time() - last >= max_age_s

    def rotation_check_due(self, every_s: float) -> bool:
        """True at most once per ``every_s``: whether to ask the upstream for its key set now."""
        with self._lock:
            now = time.monotonic()
            if now - self._last_rotation_check < every_s:
                return False
            self._last_rotation_check = now
            return True

    def count_pulled(self, size: int) -> None:
        with self._lock:
            self.bytes_pulled += size

    def count_record(self) -> None:
        with self._lock:
            self.records_pulled += 1

    def count_served(self, size: int) -> None:
        with self._lock:
            self.bytes_served += size
