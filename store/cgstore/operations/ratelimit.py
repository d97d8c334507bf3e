"""A token bucket on bytes: keeps a background task's reads under a rate, so serving traffic keeps the disk.

``take(n)`` spends ``n`` tokens and, when the bucket runs dry, sleeps until
the debt is repaid at ``rate`` tokens per second. The bucket holds at most
``burst`` tokens, so an idle spell never buys a long full-speed stretch.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """At most ``rate`` bytes per second on average, bursts of at most ``burst`` bytes."""

    def __init__(
        self,
        rate: float,
        burst: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate, self.burst = rate, burst
        self._clock, self._sleep = clock, sleep
        self._tokens = burst
        self._last = clock()

    def take(self, amount: int) -> None:
        """Spend ``amount`` tokens, first sleeping as long as the bucket is in debt."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= amount
        if self._tokens < 0:
            self._sleep(-self._tokens / self.rate)
            # The sleep repaid the debt; refill is counted from when it ended.
            self._last = self._clock()
            self._tokens = 0.0
