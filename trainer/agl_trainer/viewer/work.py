"""The viewer's API work: a bounded pool of threads, a time budget per request, and cancellation.

Assembling and rendering a big rollout takes seconds; before, each request took a thread of its own
and ran to the end even when its client had gone, so 8 abandoned requests for a huge rollout hung
every API call. Now each request runs in a pool of `workers` threads with at most `max_pending`
requests admitted (more: 503 at once, "busy"); the handler answers 504 once the request's budget is
spent and the client's disconnect abandons it; either way the work is told to stop (`Ticket`),
and stops at its next check (detail.py, assembly: every 256 calls, every sample).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

POLL_S = 0.2  # how often a waiting handler looks for its client's disconnect


class Stopped(Exception):
    """The request's work was told to stop (its budget was spent, or its client left)."""


class Busy(Exception):
    """More requests than the viewer admits at once."""


class Ticket:
    """One request's work: `check()` raises Stopped once `stop()` was called (from the event loop)."""

    def __init__(self) -> None:
        self._stopped = threading.Event()
        self.why = ""

    def stop(self, why: str) -> None:
        self.why = why
        self._stopped.set()

    def check(self) -> None:
        if self._stopped.is_set():
            raise Stopped(self.why)


class Pool:
    """Runs API work off the event loop, bounded, with a budget; counts what happened (`stats`)."""

    def __init__(self, workers: int = 2, max_pending: int = 16, budget_s: float = 30.0) -> None:
        self.budget_s = budget_s
        self.max_pending = max_pending
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agl-viewer-api")
        self._lock = threading.Lock()
        self.pending = 0  # admitted and not finished (running or queued), abandoned ones included
        self.stats = {"over_budget": 0, "abandoned": 0, "stopped": 0, "busy": 0}

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _count(self, name: str) -> None:
        with self._lock:
            self.stats[name] += 1

    async def run(self, request: web.Request, function: Callable[[Ticket], Any]) -> Any:
        """`function(ticket)`'s result; raises Busy, or TimeoutError once the budget is spent (the work
        is told to stop), or CancelledError when the client left (likewise)."""
        with self._lock:
            if self.pending >= self.max_pending:
                self.stats["busy"] += 1
                raise Busy(f"the viewer is busy ({self.pending} requests at work); try again shortly")
            self.pending += 1
        ticket = Ticket()

        def work() -> Any:
            try:
                ticket.check()  # abandoned while queued: do nothing
                return function(ticket)
            except Stopped:
                self._count("stopped")
                raise
            finally:
                with self._lock:
                    self.pending -= 1

        future = asyncio.get_running_loop().run_in_executor(self._executor, work)
        deadline = asyncio.get_running_loop().time() + self.budget_s
        try:
            while True:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    ticket.stop("over budget")
                    self._count("over_budget")
                    future.add_done_callback(_consume)
                    raise TimeoutError
                done, _ = await asyncio.wait({future}, timeout=min(POLL_S, left))
                if done:
                    return future.result()
                transport = request.transport
                if transport is None or transport.is_closing():
                    raise asyncio.CancelledError
        except asyncio.CancelledError:  # the client left (seen here, or aiohttp cancelled the handler)
            ticket.stop("client left")
            self._count("abandoned")
            future.add_done_callback(_consume)
            raise


def _consume(future: asyncio.Future) -> None:
    """Nobody awaits an abandoned request's result: read its exception so asyncio logs nothing."""
    if not future.cancelled():
        future.exception()
