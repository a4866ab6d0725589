"""Which complete groups a step trains: the oldest (long rollouts first) or the first to complete."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_trainer.loop.groups import Group, Member
from agl_trainer.loop.inflight import InFlight
from agl_trainer.loop.progress import LoopProgress


def inflight(tmp_path: Path, **loop: object) -> InFlight:
    from agl_trainer.config import LoopConfig

    config = LoopConfig(**{"batch_rollouts": 2, "group_size": 2, **loop})  # type: ignore[arg-type]
    return InFlight(
        config, schedule=None, runner=None, journal=None, data=None,  # type: ignore[arg-type]
        progress=LoopProgress(1, 2, enabled=False), on_fatal=lambda error: None,
    )  # fmt: skip


def complete_group(index: int, ended_at: float) -> Group:
    ids = [f"g{index}-0", f"g{index}-1"]
    group = Group(index, {"id": f"t{index}"}, 0, ids, states=dict.fromkeys(ids, Member.COMPLETE))
    group.exited_at = {ids[0]: ended_at - 1.0, ids[1]: ended_at}
    return group


@pytest.mark.parametrize(("oldest_first", "trained"), [(True, 3), (False, 7)])
def test_a_step_takes_the_oldest_group_or_the_first_to_complete(tmp_path: Path, oldest_first, trained) -> None:
    groups = inflight(tmp_path, oldest_first=oldest_first, staleness=5)
    # group 3 was launched first but its slowest member ended last; group 7 ended first
    groups.groups = {3: complete_group(3, ended_at=50.0), 7: complete_group(7, ended_at=20.0)}
    batch = groups.ready_batch(version=0)
    assert batch is not None and [g.index for g in batch] == [trained]


def test_a_group_at_the_bound_trains_whatever_the_order(tmp_path: Path) -> None:
    groups = inflight(tmp_path, oldest_first=False, staleness=1)
    groups.groups = {3: complete_group(3, ended_at=50.0), 7: complete_group(7, ended_at=20.0)}
    groups.groups[7].launched_version = 1
    # at version 1, group 3 (launched under 0) would be too stale after the update: it trains now too
    batch = groups.ready_batch(version=1)
    assert batch is not None and sorted(g.index for g in batch) == [3, 7]
