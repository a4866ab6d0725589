"""Bounded exponential backoff with jitter for the Kubernetes API: a server away for a moment (a
restart, a load balancer in between) or shedding load (429, 5xx) costs a rollout a delay, not a fail.

Transient: no answer at all (connection refused or reset, a timeout) and the statuses 429, 500, 502,
503, 504. A 429 (or 503) with Retry-After waits at least that long. Anything else (403, 404, 409,
422) is the answer and goes back at once. Once `attempts` tries are spent the call raises
`ApiUnavailable`, whose message names the API server, the last status and the tries: the runner
turns it into a failed attempt with that cause (infra_error: the next attempt tries again later).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Backoff:
    attempts: int = 6  # tries in all, the first included
    base_s: float = 0.5  # the first retry waits up to this, each later one up to twice the one before
    max_s: float = 30.0  # no wait longer than this, Retry-After included

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_s < 0 or self.max_s < self.base_s:
            raise ValueError("attempts must be >= 1 and 0 <= base_s <= max_s")

    def delay(self, retry: int, retry_after: float | None = None, rng: random.Random | None = None) -> float:
        """Seconds before retry number `retry` (0: the first): "full jitter", uniform in [0, cap], so
        rollouts that failed together do not come back together; never less than Retry-After."""
        cap = min(self.max_s, self.base_s * 2**retry)
        wait = (rng or random).uniform(0, cap)
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.max_s))
        return wait


class ApiUnavailable(Exception):
    """The API server did not answer, or answered only transient errors, for every try."""

    def __init__(self, message: str, last: BaseException) -> None:
        super().__init__(message)
        self.last = last


def is_transient(error: BaseException) -> bool:
    status = getattr(error, "status", None)
    if _is_api_exception(error):
        return status in TRANSIENT_STATUSES or not status  # status 0: the client got no response
    import urllib3.exceptions

    return isinstance(error, (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError, OSError))


def retry_after(error: BaseException) -> float | None:
    """The Retry-After header of an API error, in seconds (delta-seconds or an HTTP date)."""
    headers = getattr(error, "headers", None) or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def describe(error: BaseException) -> str:
    """An ApiException as 'status reason: the API server's message'; anything else as itself."""
    status, reason = getattr(error, "status", None), getattr(error, "reason", None)
    body = getattr(error, "body", None)
    if not _is_api_exception(error) or not status:
        return str(error) or type(error).__name__
    message = ""
    try:
        message = json.loads(body).get("message", "")
    except Exception:  # not a Status body: the reason says enough
        pass
    return f"{status} {reason}" + (f": {message}" if message else "")


async def call_with_backoff(
    call: Callable[[], Awaitable[Any]],
    backoff: Backoff,
    host: str,
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    on_retry: Callable[[BaseException, float], None] | None = None,
) -> Any:
    """`call()` again after a transient failure, up to backoff.attempts tries in all."""
    started = time.monotonic()
    for retry in range(backoff.attempts):
        try:
            return await call()
        except Exception as error:
            if not is_transient(error):
                raise
            if retry + 1 >= backoff.attempts:
                message = unavailable(host, error, backoff.attempts, time.monotonic() - started)
                raise ApiUnavailable(message, error) from error
            wait = backoff.delay(retry, retry_after(error))
            if on_retry is not None:
                on_retry(error, wait)
            await sleep(wait)
    raise AssertionError("unreachable")


def unavailable(host: str, error: BaseException, tries: int, seconds: float) -> str:
    status = getattr(error, "status", None)
    answered = _is_api_exception(error) and status
    what = f"answered {describe(error)}" if answered else f"did not answer ({describe(error)})"
    return f"the Kubernetes API server at {host} {what}, {tries} tries in {seconds:.1f} s"


def _is_api_exception(error: BaseException) -> bool:
    from kubernetes.client.exceptions import ApiException

    return isinstance(error, ApiException)
