"""loop.skip_flat_groups (DAPO's dynamic sampling): a group whose rollouts all got one reward trains
nothing, so it is set aside (recorded in the store) and another group takes its place in the batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agl_trainer.assembly.config import AssemblyConfig
from agl_trainer.config import ConfigError, LoopConfig, check_loop
from agl_trainer.loop.groups import FLAT_GROUP, Group, Member, is_flat
from agl_trainer.loop.ports import GroupRewards
from agl_trainer.run.dataplane import StoreDataPlane
from agl_trainer.store import RolloutKey, RolloutStore
from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import call_span, reward_span, rollout_span
from tests.loop.test_loop import make_config, model_dir, run_session, store_of  # noqa: F401 (fixture)

# Tasks a and c give every rollout the same reward; b and d give a group's members 0 and 1.
TASKS = [{"id": "a", "reward": 1.0}, {"id": "b"}, {"id": "c", "reward": 0.0}, {"id": "d"}]
FLAT_TASKS = {"a", "c"}


@pytest.mark.parametrize(
    ("rewards", "flat"),
    [([1.0, 1.0], True), ([0.0, 0.0, 0.0], True), ([0.0, -0.0], True), ([1.0, 0.5], False), ([1.0], False),
     ([], False), ([float("nan")] * 2, False)],
)  # fmt: skip
def test_a_group_is_flat_when_two_or_more_rewards_are_all_equal(rewards, flat) -> None:
    assert is_flat(rewards) is flat


def test_group_rewards_are_the_rewards_assembly_would_train_with(tmp_path: Path) -> None:
    with RolloutStore(tmp_path / "r.db", grace_s=0) as store:  # a harness exit completes its rollout at once
        prompt, answer = [1, 2, 3], [4, 5]
        spans = []
        for rid, reward in [("twice", 0.25), ("once", 1.0), ("none", None), ("lost", 1.0), ("per-call", 1.0)]:
            spans.append(call_span(rid, 0, prompt, answer))
            if rid != "lost":  # its harness died before the end span
                spans.append(rollout_span(rid))
            if reward is not None:
                spans.append(reward_span(rid, reward, end_ns=2_000_000_000_000_000_000))
        spans.append(reward_span("twice", 0.75, end_ns=1_000_000_000_000_000_000))  # earlier: not the final one
        spans.append(reward_span("per-call", 0.5, call_seq=0))
        ingest(store, spans)
        data = StoreDataPlane(store)
        data.harness_exited(RolloutKey("lost", 0), None, "infra_error")  # cause policy: drop
        key = lambda rid: RolloutKey(rid, 0)  # noqa: E731
        assert data.group_rewards([key("twice"), key("once")]) == GroupRewards([0.25, 1.0], awaited=0)
        # "none" has no reward yet (one may come: awaited); "lost" ended for a cause that never trains
        assert data.group_rewards([key("once"), key("none"), key("lost")]) == GroupRewards([1.0], awaited=1)
        assert data.group_rewards([key("once"), key("per-call")]) is None  # per-call rewards: not judged
        assert data.group_rewards([key("unknown")]) == GroupRewards([], awaited=0)
        zero_if_missing = StoreDataPlane(store, AssemblyConfig(missing_reward=0.0))
        assert zero_if_missing.group_rewards([key("none"), key("once")]) == GroupRewards([0.0, 1.0], awaited=1)


class RewardsSoFar:
    """A data plane whose rewards arrive when the test says (as a grader's come through the sidecar)."""

    def __init__(self) -> None:
        self.found = GroupRewards([1.0], awaited=1)
        self.dropped: list[tuple[RolloutKey, str]] = []

    def group_rewards(self, keys: Any) -> GroupRewards:
        return self.found

    def mark_dropped(self, keys: list[RolloutKey], reason: str) -> None:
        self.dropped += [(key, reason) for key in keys]


def test_a_group_whose_rewards_are_still_coming_is_judged_once_they_are_in(monkeypatch) -> None:
    from agl_trainer.loop import inflight as inflight_module
    from agl_trainer.loop.inflight import InFlight
    from agl_trainer.loop.progress import LoopProgress

    data = RewardsSoFar()
    groups = InFlight(
        LoopConfig(batch_rollouts=2, group_size=2, skip_flat_groups=True), schedule=None, runner=None,  # type: ignore[arg-type]
        journal=None, data=data, progress=LoopProgress(1, 2, enabled=False),  # type: ignore[arg-type]
    )  # fmt: skip
    ids = ["g0-0", "g0-1"]
    groups.groups = {0: Group(0, {"id": "t"}, 0, ids, states=dict.fromkeys(ids, Member.COMPLETE))}
    assert groups.ready_batch(version=0) is None  # one reward in so far: neither trained nor set aside
    assert data.dropped == [] and 0 in groups.groups
    data.found = GroupRewards([1.0, 1.0], awaited=0)  # the second arrives: equal, so the group leaves
    assert groups.ready_batch(version=0) is None
    assert [reason for _, reason in data.dropped] == [FLAT_GROUP, FLAT_GROUP] and groups.groups == {}
    assert groups.flat_set_aside == 2
    # A reward that never comes: after REWARD_WAIT_S the group is judged on those it has (one: trains)
    groups.groups = {1: Group(1, {"id": "u"}, 0, ["g1-0", "g1-1"], states=dict.fromkeys(["g1-0", "g1-1"], Member.COMPLETE))}
    data.found = GroupRewards([0.0], awaited=1)
    assert groups.ready_batch(version=0) is None
    monkeypatch.setattr(inflight_module, "REWARD_WAIT_S", 0.0)
    batch = groups.ready_batch(version=0)
    assert batch is not None and [g.index for g in batch] == [1] and len(data.dropped) == 2


def test_skip_flat_groups_needs_groups_of_two_or_more() -> None:
    with pytest.raises(ConfigError, match="loop.skip_flat_groups.*group_size=1.*fix: loop.group_size 2 or more"):
        check_loop(LoopConfig(skip_flat_groups=True, group_size=1, batch_rollouts=4))
    check_loop(LoopConfig(skip_flat_groups=True, group_size=2, batch_rollouts=4))


@pytest.fixture
def rewards_always_awaited(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reward in these runs arrives: a group waits for all of its own however slow the machine
    (REWARD_WAIT_S bounds the wait for a reward that never comes; here none is missing)."""
    from agl_trainer.loop import inflight as inflight_module

    monkeypatch.setattr(inflight_module, "REWARD_WAIT_S", float("inf"))


def trained_and_set_aside(config: Any) -> tuple[dict[str, str], dict[str, str]]:
    """Rollout id -> task id, for the trained rollouts and for those set aside as flat."""
    with store_of(config) as store:
        infos = store.find("")
    trained = {i.rollout_id: str(i.task_id) for i in infos if i.trained_step is not None}
    flat = {i.rollout_id: str(i.task_id) for i in infos if i.dropped_reason == FLAT_GROUP}
    return trained, flat


@pytest.mark.slow
@pytest.mark.usefixtures("rewards_always_awaited")
@pytest.mark.parametrize("mode", ["sync", "collocated-async"])
def test_flat_groups_are_set_aside_and_the_batch_is_filled_with_groups_that_teach(
    tmp_path: Path, model_dir: Path, mode: str  # noqa: F811
) -> None:
    config = make_config(
        tmp_path, model_dir, TASKS, "tests.loop.harnesses:flat_or_mixed",
        mode=mode, batch_rollouts=4, group_size=2, concurrency=4, max_steps=2, skip_flat_groups=True,
    )  # fmt: skip
    result = run_session(config)
    assert result.summary.steps == 2 and result.summary.failures == {}
    trained, flat = trained_and_set_aside(config)
    assert len(trained) == 8 and set(trained.values()) <= {"b", "d"}  # full batches, of groups that teach
    assert flat and set(flat.values()) <= FLAT_TASKS
    history = result.summary.history
    assert [m["rollouts/trained"] for m in history] == [4.0, 4.0]
    assert [m["advantage/flat_groups"] for m in history] == [0.0, 0.0]
    assert [m["reward/mean"] for m in history] == [0.5, 0.5]
    assert sum(m["rollouts/set_aside_flat"] for m in history) <= len(flat)  # async: more may end after
    if mode == "sync":  # every launched group ended before its step: each flat one was set aside there
        assert sum(m["rollouts/set_aside_flat"] for m in history) == len(flat)


@pytest.mark.slow
def test_without_the_option_flat_groups_train(tmp_path: Path, model_dir: Path) -> None:  # noqa: F811
    config = make_config(
        tmp_path, model_dir, TASKS, "tests.loop.harnesses:flat_or_mixed",
        mode="sync", batch_rollouts=8, group_size=2, concurrency=8, max_steps=1,
    )  # fmt: skip
    result = run_session(config)
    trained, flat = trained_and_set_aside(config)
    assert sorted(trained.values()) == ["a", "a", "b", "b", "c", "c", "d", "d"] and flat == {}
    assert result.summary.history[0]["advantage/flat_groups"] == 2.0
    assert "rollouts/set_aside_flat" not in result.summary.history[0]


@pytest.mark.slow
@pytest.mark.usefixtures("rewards_always_awaited")
def test_past_the_limit_flat_groups_train_as_they_come(
    tmp_path: Path, model_dir: Path, capfd: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    config = make_config(
        tmp_path, model_dir, [{"id": "a", "reward": 1.0}, {"id": "c", "reward": 0.0}],
        "tests.loop.harnesses:flat_or_mixed",
        mode="sync", batch_rollouts=4, group_size=2, concurrency=4, max_steps=1, skip_flat_groups=True,
        flat_skip_limit=1,
    )  # fmt: skip
    result = run_session(config)
    trained, flat = trained_and_set_aside(config)
    assert len(flat) == 4 and len(trained) == 4  # one batch's worth set aside, then the next batch trains
    assert result.summary.history[0]["rollouts/set_aside_flat"] == 4.0
    assert result.summary.history[0]["advantage/flat_groups"] == 2.0
    assert "loop.flat_skip_limit=1: 4 rollouts in flat groups set aside since the last step" in capfd.readouterr().err


def test_a_resume_does_not_relaunch_a_group_set_aside_as_flat(tmp_path: Path) -> None:
    from agl_testing.rollouts import write_rollouts

    from agl_trainer.loop.checkpoint import LoopState
    from agl_trainer.loop.groups import Group, GroupJournal, Member, TaskSchedule
    from agl_trainer.run.session import recover_groups

    tasks = [{"id": "task-0"}, {"id": "task-1"}]
    journal = GroupJournal(tmp_path / "groups.jsonl")
    for index in (0, 1):  # launched by the run that stopped, neither trained
        journal.append(Group(index, tasks[index], 0, [f"r-{2 * index}", f"r-{2 * index + 1}"]))
    journal.close()
    with RolloutStore(tmp_path / "r.db", grace_s=0) as store:
        write_rollouts(store, ["r-0", "r-1", "r-2", "r-3"], tasks=1)
        store.refresh_completion()
        StoreDataPlane(store).mark_dropped([RolloutKey("r-0", 0), RolloutKey("r-1", 0)], FLAT_GROUP)
        schedule = TaskSchedule(tasks, 2, 0, "run")
        recovered = recover_groups(tmp_path / "groups.jsonl", schedule, tasks, StoreDataPlane(store), LoopState())
    assert [group.index for group in recovered] == [1]  # group 0 was set aside as flat: not run again
    assert recovered[0].states == {"r-2": Member.COMPLETE, "r-3": Member.COMPLETE} and schedule.next_index == 2
