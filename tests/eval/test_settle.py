"""agl eval reads its attempts only once the sidecar has delivered their spans: GET state reports the
span counts in `counters` (a pause's answer has them at the top), and every sidecar of a fleet counts."""

from __future__ import annotations

import asyncio

from agl_trainer.run.evaluation import spans_delivered
from agl_trainer.loop.ports import SidecarState


class Admin:
    """Answers GET state as the sidecar does: in flight at the top, span counts in counters."""

    def __init__(self, answers: list[tuple[int, dict[str, int]]]) -> None:
        self.answers = answers
        self.reads = 0

    async def state(self) -> SidecarState:
        in_flight, counters = self.answers[min(self.reads, len(self.answers) - 1)]
        self.reads += 1
        return SidecarState(in_flight=in_flight, counters=dict(counters))


class Fleet:
    def __init__(self, admins: list[Admin]) -> None:
        self.admins = admins


def test_waits_for_in_flight_and_undelivered_spans_in_counters() -> None:
    admin = Admin([(1, {}), (0, {"spans_building": 1}), (0, {"spans_pending": 2}), (0, {"spans_sending": 2}),
                   (0, {"spans_in_spool": 1}), (0, {"spans_pending": 0, "spans_failed": 3})])  # fmt: skip
    asyncio.run(spans_delivered(admin, timeout_s=30))
    assert admin.reads == 6  # failed spans are gone for good: nothing to wait for


def test_every_sidecar_of_a_fleet_is_waited_for() -> None:
    quiet, busy = Admin([(0, {})]), Admin([(0, {"spans_pending": 1}), (0, {"spans_pending": 1}), (0, {})])
    asyncio.run(spans_delivered(Fleet([quiet, busy]), timeout_s=30))
    assert busy.reads == 3 and quiet.reads == 3
