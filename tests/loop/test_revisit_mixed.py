"""loop.revisit_mixed: a task whose trained group got mixed rewards is drawn again ahead of the seeded
order, up to that many more times, so steps hold more groups with a signal (a curriculum at the edge of
what the policy can do)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from agl_trainer.config import ConfigError, LoopConfig, check_loop
from agl_trainer.loop.groups import GroupJournal, TaskSchedule, is_mixed
from tests.loop.test_flat_groups import FLAT_TASKS, TASKS, rewards_always_awaited  # noqa: F401 (fixture)
from tests.loop.test_loop import make_config, model_dir, run_session  # noqa: F401 (fixture)


@pytest.mark.parametrize(
    ("rewards", "mixed"),
    [([0.0, 1.0], True), ([1.0, 1.0, 0.5], True), ([1.0, 1.0], False), ([1.0], False), ([], False),
     ([float("nan"), 1.0], False), ([float("nan"), 0.0, 1.0], True), ([float("inf"), 1.0], False)],
)  # fmt: skip
def test_a_group_is_mixed_when_two_or_more_finite_rewards_differ(rewards, mixed) -> None:
    assert is_mixed(rewards) is mixed


def test_revisits_go_first_up_to_the_limit_and_the_seeded_order_goes_on_where_it_was() -> None:
    tasks = [{"id": f"t{i}"} for i in range(5)]
    plain = TaskSchedule(tasks, 2, seed=3, run_id="run")
    order = [plain.next_group(0).task_id for _ in range(5)]
    schedule = TaskSchedule(tasks, 2, seed=3, run_id="run", revisits=2)
    first = schedule.next_group(0)
    assert first.task_id == order[0] and not first.revisit
    assert schedule.revisit(first.task) and schedule.revisit(first.task)
    assert not schedule.revisit(first.task)  # a third time: past revisits=2
    drawn = [schedule.next_group(0) for _ in range(4)]
    assert [(g.task_id, g.revisit) for g in drawn] == [
        (order[0], True), (order[0], True), (order[1], False), (order[2], False),
    ]  # fmt: skip
    assert [g.index for g in drawn] == [1, 2, 3, 4] and schedule.fresh_index == 3
    assert drawn[0].to_json()["revisit"] is True and "revisit" not in drawn[2].to_json()
    assert drawn[0].rollout_ids == ["run-g000001-0", "run-g000001-1"]  # ids by launch, as before
    assert not TaskSchedule(tasks, 2, seed=3, run_id="run").revisit(tasks[0])  # revisits=0: never queued


def test_a_resume_goes_on_with_the_seeded_order_and_the_revisits_counted(tmp_path: Path) -> None:
    tasks = [{"id": f"t{i}"} for i in range(6)]
    schedule = TaskSchedule(tasks, 1, seed=0, run_id="run", revisits=1)
    journal = GroupJournal(tmp_path / "groups.jsonl")
    launched = [schedule.next_group(0)]
    schedule.revisit(launched[0].task)
    launched += [schedule.next_group(0) for _ in range(2)]  # the revisit, then the seeded order's second
    for group in launched:
        journal.append(group)
    journal.close()
    resumed = TaskSchedule(tasks, 1, seed=0, run_id="run", revisits=1)
    resumed.resume(GroupJournal.read(tmp_path / "groups.jsonl"), next_index=0)
    assert (resumed.next_index, resumed.fresh_index) == (3, 2)
    assert resumed.next_group(0).task_id == schedule.next_group(0).task_id  # the seeded order's third
    assert not resumed.revisit(launched[0].task)  # its one revisit was journaled
    assert resumed.revisit(launched[2].task)


def test_revisit_mixed_needs_groups_of_two_or_more() -> None:
    with pytest.raises(ConfigError, match="loop.revisit_mixed.*group_size=1.*fix: loop.group_size 2 or more"):
        check_loop(LoopConfig(revisit_mixed=1, group_size=1, batch_rollouts=4))
    check_loop(LoopConfig(revisit_mixed=1, group_size=2, batch_rollouts=4))


@pytest.mark.slow
@pytest.mark.usefixtures("rewards_always_awaited")
def test_a_sync_run_draws_the_tasks_whose_groups_were_mixed_again(
    tmp_path: Path, model_dir: Path  # noqa: F811
) -> None:
    """Tasks b and d give a group 0 and 1 (mixed), a and c one reward (flat): after each step, the mixed
    tasks it trained come back first, each once (revisit_mixed=1), then the seeded order goes on."""
    config = make_config(
        tmp_path, model_dir, TASKS, "tests.loop.harnesses:flat_or_mixed",
        mode="sync", batch_rollouts=4, group_size=2, concurrency=4, max_steps=3, revisit_mixed=1,
    )  # fmt: skip
    result = run_session(config)
    assert result.summary.steps == 3 and result.summary.failures == {}
    journal = GroupJournal.read(Path(config.output_dir) / "groups.jsonl")
    drawn = [(e["task_id"], bool(e.get("revisit"))) for e in journal]

    order = TaskSchedule(TASKS, 2, config.seed, "run")
    fresh = iter(order.task_for(i)["id"] for i in range(12))
    queue: list[str] = []
    revisited: Counter[str] = Counter()
    expected = []
    for _ in range(3):  # a step: two groups, revisits first; after it, its mixed tasks are queued once
        batch = [(queue.pop(0), True) if queue else (next(fresh), False) for _ in range(2)]
        expected += batch
        for task, _ in batch:
            if task not in FLAT_TASKS and not revisited[task]:
                revisited[task] += 1
                queue.append(task)
    assert drawn == expected
    assert any(again for _, again in drawn)  # the seed's order puts a mixed task in an early step
    revisits = [m["groups/revisits"] for m in result.summary.history]
    assert revisits == [sum(again for _, again in expected[2 * s : 2 * s + 2]) for s in range(3)]


def test_a_run_from_a_store_refuses_revisits_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agl_trainer.cli import main
    from agl_trainer.store import RolloutStore
    from examples.demo.model import build_demo_model

    with RolloutStore(tmp_path / "r.db"):
        pass
    model = build_demo_model(tmp_path / "tiny", seed=0)
    code = main(["train", "--from-store", str(tmp_path / "r.db"), f"--model.path={model}",
                 f"--output_dir={tmp_path / 'run'}", "--loop.revisit_mixed=2"])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "loop.revisit_mixed" in err and "fix: leave it 0" in err, err
    assert "Traceback" not in err
