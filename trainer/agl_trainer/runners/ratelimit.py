"""A token bucket for asyncio: at most `rate` acquisitions a second, `burst` of them back to back.

The Kubernetes runner spaces Job creations with it, so a training step's batch of rollouts does not
arrive at the API server (and its admission webhooks, quota controller) as one burst.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


class RateLimiter:
    def __init__(
        self,
        rate: float,
        burst: int = 1,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate, self.burst = rate, burst
        self._clock, self._sleep = clock, sleep
        self._tokens = float(burst)
        self._last = clock()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:  # first come, first served
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + max(0.0, now - self._last) * self.rate)
            self._last = now
            if self._tokens < 1:
                wait = (1 - self._tokens) / self.rate
                await self._sleep(wait)
                self._tokens, self._last = 1.0, max(self._clock(), now + wait)
            self._tokens -= 1
