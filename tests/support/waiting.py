"""Waiting in tests: poll a condition until it holds, or fail naming what never happened."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], what: str = "the condition", timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


async def wait_until_async(predicate: Callable[[], object], what: str = "the condition", timeout: float = 20.0) -> None:
    """`wait_until` for a test whose own event loop must keep running (its requests are in flight on it)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.01)
