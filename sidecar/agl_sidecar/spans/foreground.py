"""Which work goes first on the sidecar's one event loop.

Model calls are foreground: a call counts as active while the proxy works on it, and not while it
waits on the engine, the gate or a hosted provider. Background work (building spans) runs its
slices when no call is active, so a span's encoding fills the time the proxy spends waiting on the
engine instead of delaying the next call. asyncio runs ready tasks round-robin, which would put a
slice between every two steps of a call; this keeps the two apart.

Right after the last call in flight ends, background work waits `settle_s` more: a harness that
calls again at once (an agent loop, a benchmark) sends its next call within that time, and the
call's wait on the engine is a better time for the work than the moment its request arrives. A
background task waits at most `max_wait_s` for a quiet loop, so it makes progress under sustained
load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

# A harness that calls again at once does so within ~0.5 ms on loopback; an agent that runs a tool
# first takes far longer, and the span is then built in the pause.
SETTLE_S = 0.002


class Foreground:
    __slots__ = ("_changed", "_last_end", "_waiters", "active", "in_flight", "settle_s")

    def __init__(self, settle_s: float = SETTLE_S) -> None:
        self.active = 0  # calls the proxy is working on now
        self.in_flight = 0  # calls begun and not ended: active, or waiting on the engine or the gate
        self.settle_s = settle_s
        self._last_end = float("-inf")
        self._changed: asyncio.Event | None = None
        self._waiters = 0

    # --- a call's lifetime ---------------------------------------------------------------------
    def begin(self) -> None:
        """A call arrived (and is active)."""
        self.in_flight += 1
        self.enter()

    def end(self) -> None:
        """The call is answered."""
        self.leave()
        self.in_flight -= 1
        if self.in_flight == 0:
            self._last_end = time.monotonic()

    def enter(self) -> None:
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0 and self._waiters:
            assert self._changed is not None
            self._changed.set()

    async def waiting(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable` (the engine, the gate) as a call that is not active meanwhile."""
        self.leave()
        try:
            return await awaitable
        finally:
            self.enter()

    # --- background work -----------------------------------------------------------------------
    @property
    def background_waiting(self) -> bool:
        """Background work is waiting for a quiet loop (it has work and put it off)."""
        return self._waiters > 0

    def quiet_now(self) -> bool:
        """No call is active, and either one waits on the engine or the last one settled."""
        if self.active > 0:
            return False
        return self.in_flight > 0 or time.monotonic() - self._last_end >= self.settle_s

    async def quiet(self, max_wait_s: float) -> None:
        """Return once `quiet_now()`, or after `max_wait_s`."""
        deadline = time.monotonic() + max_wait_s
        while not self.quiet_now():
            now = time.monotonic()
            wait = deadline - now
            if wait <= 0:
                return
            if self.active == 0:  # between calls: settling ends the wait too
                wait = min(wait, self._last_end + self.settle_s - now)
            await self._next_change(wait)

    async def _next_change(self, timeout_s: float) -> None:
        """Wait until no call is active (after a call became active), or `timeout_s`."""
        if self._changed is None:
            self._changed = asyncio.Event()
        changed = self._changed
        changed.clear()
        timer = asyncio.get_running_loop().call_later(max(timeout_s, 0.0), changed.set)
        self._waiters += 1
        try:
            await changed.wait()
        finally:
            self._waiters -= 1
            timer.cancel()
