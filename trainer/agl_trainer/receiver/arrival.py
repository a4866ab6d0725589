"""A reward's time, as the receiver lets it order the rewards of a rollout.

For one name the reward that ended last wins (store/records.py `final_reward`). A sender's clock
is its own: a reward dated 2^63 - 1 (a broken clock, a forged record) would beat every correction
sent after it, and rewards that give no time would tie, their span ids deciding. So a reward cannot
have ended after it arrived: one dated after its arrival, or not dated at all, is stored as ending
when it arrived. Arrivals are stamped in the order the receiver decodes its requests, strictly
increasing (a request's rewards in their order), so untimed rewards are ordered by arrival too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import msgspec

from agl_trainer.store.records import Record, RewardSpan


class Arrivals:
    """Strictly increasing arrival times (ns since the epoch) from a wall clock."""

    def __init__(self, clock: Callable[[], int] = time.time_ns) -> None:
        self._clock = clock
        self._last = 0
        self._lock = threading.Lock()  # requests are decoded on several threads

    def settle(self, records: list[Record]) -> list[Record]:
        """`records` with each reward's end time at most its arrival (its arrival when it has none)."""
        settled = records
        for index, record in enumerate(records):
            if type(record) is not RewardSpan:
                continue
            with self._lock:
                self._last = arrived = max(self._clock(), self._last + 1)
            if record.end_ns == 0 or record.end_ns > arrived:
                if settled is records:
                    settled = list(records)
                settled[index] = msgspec.structs.replace(record, end_ns=arrived)
        return settled
