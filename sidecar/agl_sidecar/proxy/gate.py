"""The gate every model call passes: open, or paused while training updates the weights.

A paused gate holds new calls (never fails them) and lets calls already in flight finish; `resume`
releases held calls in arrival order under the new policy version. A call held longer than
`max_hold_s` is refused (the handler answers 503 with Retry-After).

A drain-free switch (loop.switch: keep) pauses without draining: the engine freezes the calls in
flight, and `resume(version, switch=True, progress=...)` records where the new version starts in
them (`switches`, see calls/switches.py). A resume to a lower version than the one in force (a new
run on an attached sidecar, a trainer resumed from an older checkpoint) starts a new switch log: the
calls that enter under it see only the switches after it, and the calls in flight keep the log they
entered with, so a span's versions only ever rise from its entry version.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping

from agl_sidecar.calls.switches import SwitchLog


class HeldTooLong(Exception):
    """A call waited longer than max_hold_s for the gate to open."""


class LowerSwitch(ValueError):
    """A drain-free switch to a version below the one in force (a switch only moves forward)."""


class Gate:
    def __init__(self, max_hold_s: float, policy_version: int = 0) -> None:
        self.max_hold_s = max_hold_s
        self.policy_version = policy_version
        self.paused = False
        self.in_flight = 0
        self._held: deque[asyncio.Future[None]] = deque()
        self._drained: list[asyncio.Future[None]] = []
        self.switches = SwitchLog()

    @property
    def held(self) -> int:
        return sum(1 for waiter in self._held if not waiter.done())

    async def enter(self) -> tuple[int, float]:
        """Wait until the gate is open; returns (policy version in force, ms held)."""
        if not self.paused:
            self.in_flight += 1
            return self.policy_version, 0.0
        started = time.monotonic()
        waiter = asyncio.get_running_loop().create_future()
        self._held.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.max_hold_s)
        except TimeoutError:
            waiter.cancel()
            raise HeldTooLong from None
        except asyncio.CancelledError:
            waiter.cancel()
            raise
        finally:
            if self._held and self._held[0] is waiter:
                self._held.popleft()
            else:
                try:
                    self._held.remove(waiter)
                except ValueError:
                    pass
        self.in_flight += 1
        return self.policy_version, (time.monotonic() - started) * 1000.0

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._drained:
            waiters, self._drained = self._drained, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def pause(self) -> None:
        self.paused = True

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no call is in flight; False on timeout."""
        if self.in_flight == 0:
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._drained.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            return False
        return True

    def resume(
        self, policy_version: int | None = None, switch: bool = False, progress: Mapping[str, int] | None = None
    ) -> None:
        """Open the gate; held calls continue in arrival order (their futures resolve in order, and
        asyncio wakes tasks in the order their futures complete). `switch`: calls in flight were
        frozen, not drained, and continue under `policy_version` (recorded before any is released)."""
        if policy_version is not None:
            if policy_version < self.policy_version:
                if switch:
                    raise LowerSwitch(policy_version)
                self.switches = SwitchLog(unresolved=self.switches.unresolved)  # a new run
            elif switch and policy_version != self.policy_version:
                self.switches.record(policy_version, progress)
            self.policy_version = policy_version
        self.paused = False
        for waiter in list(self._held):
            if not waiter.done():
                waiter.set_result(None)
