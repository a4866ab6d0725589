"""Which work goes first on the sidecar's one event loop.

Model calls are foreground: a call counts as active while the proxy works on it, and not while it
waits on the engine, the gate or a hosted provider. Background work (building spans) runs its
slices when no call is active, so a span's encoding fills the time the proxy spends waiting on the
engine instead of delaying the next call. asyncio runs ready tasks round-robin, which would put a
slice between every two steps of a call; this keeps the two apart. A background task waits at most
`max_wait_s` for a quiet loop, so it makes progress under sustained load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class Foreground:
    __slots__ = ("active", "_quiet", "_waiters")

    def __init__(self) -> None:
        self.active = 0
        self._quiet: asyncio.Event | None = None
        self._waiters = 0

    def enter(self) -> None:
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0 and self._waiters:
            assert self._quiet is not None
            self._quiet.set()

    async def waiting(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable` (the engine, the gate) as a call that is not active meanwhile."""
        self.leave()
        try:
            return await awaitable
        finally:
            self.enter()

    async def quiet(self, max_wait_s: float) -> None:
        """Return once no call is active, or after `max_wait_s`."""
        if self.active <= 0:
            return
        if self._quiet is None:
            self._quiet = asyncio.Event()
        quiet = self._quiet
        quiet.clear()
        timer = asyncio.get_running_loop().call_later(max_wait_s, quiet.set)
        self._waiters += 1
        try:
            await quiet.wait()
        finally:
            self._waiters -= 1
            timer.cancel()
