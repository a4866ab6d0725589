"""A validation round reads its rollouts only after `settle` (the sidecar's POST /agl/v1/flush in a
run): a call span that reaches the store after the harness exited, later than loop.completion_grace_s,
must not cost the round that rollout."""

from __future__ import annotations

import asyncio
from typing import Any

from agl_trainer.loop.validation import Validator
from agl_trainer.runners.base import Cause, RolloutOutcome, RolloutSpec
from agl_trainer.store.records import RolloutKey


class Runner:
    async def run(self, spec: RolloutSpec) -> RolloutOutcome:
        return RolloutOutcome(spec, Cause.OK)


class Result:
    def __init__(self, rollout_id: str) -> None:
        self.rollout_id, self.reward = rollout_id, 1.0


class Assembled:
    def __init__(self, results: list[Result]) -> None:
        self.results = results


class Store:
    """The store as a round sees it: the harnesses exited and the grace is over, so every rollout is
    complete, but its call spans are there only once the sidecar delivered them (`arrived`)."""

    def __init__(self) -> None:
        self.arrived = False
        self.events: list[str] = []

    def complete(self, keys: list[RolloutKey]) -> set[RolloutKey]:
        self.events.append("complete")
        return set(keys)

    def assemble(self, keys: list[RolloutKey]) -> Assembled:
        return Assembled([Result(k.rollout_id) for k in keys] if self.arrived else [])

    def mark_dropped(self, keys: list[RolloutKey], reason: str) -> None:
        pass


def _round(store: Store, settle: Any) -> dict[str, float]:
    validator = Validator([{"id": "a"}, {"id": "b"}], runner=Runner(), data=store, run_id="run", every=1, settle=settle)
    return asyncio.run(validator.run(0, 0))


def test_without_a_settle_spans_still_on_the_way_cost_the_round_its_rollouts() -> None:
    assert _round(Store(), None)["val/failed"] == 2


def test_a_round_settles_once_its_harnesses_ended_and_then_reads_the_store() -> None:
    store = Store()

    async def settle() -> None:  # the sidecar delivers the finished calls' spans
        store.events.append("settle")
        store.arrived = True

    metrics = _round(store, settle)
    assert metrics["val/failed"] == 0 and metrics["val/count"] == 2 and metrics["val/reward"] == 1.0
    assert store.events[0] == "settle"  # before the store was read
