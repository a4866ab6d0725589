"""prepare's pieces that need no warm start: a rerun reuses a demonstration only when it is a whole
trajectory of the same task and kind (anything else is recorded again), the model's shape follows
`--layers` / `--heads`, and the command line names a shape out of range and what `--continue-from`
cannot continue from, before any training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import examples.swe_lite.demonstrations as demonstrations
from examples.swe_lite.generate import HINT_SENTENCE, generate, without_hint, write_tasks
from examples.swe_lite.demonstrations import recorded
from examples.swe_lite.prepare import hintless_tail, main, model_spec, searching_tail


def trajectory(
    task: dict, *, tests_first: bool = True, exit_status: str = "Submitted", search: bool = False, locate: bool = False
) -> str:
    shown = {"search": search, "tests_first": tests_first, "locate": locate}
    return json.dumps({
        "trajectory_format": "mini-swe-agent-1.1",
        "info": {"exit_status": exit_status, "swe_lite": shown},
        "messages": [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": task["problem_statement"]}],
    })  # fmt: skip


@pytest.fixture
def recordings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids `recorded` sent to mini-swe-agent (recording itself is tested in test_demonstrations)."""
    calls: list[str] = []

    def record(task: dict, out_dir: Path, *, tests_first: bool, locate: bool = False) -> Path:
        calls.append(task["id"])
        return Path(out_dir) / f"{task['id']}.traj.json"

    monkeypatch.setattr(demonstrations, "record", record)
    return calls


def test_a_whole_demonstration_of_the_same_task_is_reused(tmp_path: Path, recordings: list[str]) -> None:
    task = generate("demo", 1, seed=0)[0]
    path = tmp_path / f"{task['id']}.traj.json"
    path.write_text(trajectory(task))
    assert recorded(task, tmp_path, tests_first=True) == path
    assert recordings == []


@pytest.mark.parametrize(
    "kept",
    [
        "",  # empty
        '{"trajectory_format": "mini-swe-agent-1.1", "messages": [',  # cut short by an interrupted run
        "[]",  # JSON, not a trajectory
        "\xff",  # the byte 0xff (written as latin-1 below): not UTF-8
    ],
    ids=["empty", "cut-short", "not-a-trajectory", "not-utf8"],
)
def test_a_broken_file_is_recorded_again(kept: str, tmp_path: Path, recordings: list[str]) -> None:
    task = generate("demo", 1, seed=0)[0]
    (tmp_path / f"{task['id']}.traj.json").write_bytes(kept.encode("latin-1"))
    recorded(task, tmp_path, tests_first=True)
    assert recordings == [task["id"]]


def test_a_demonstration_of_another_kind_or_task_is_recorded_again(tmp_path: Path, recordings: list[str]) -> None:
    task = generate("demo", 1, seed=0, hint="path")[0]
    other_seed = generate("demo", 1, seed=1, hint="path")[0]  # the same id, another repository and bug
    assert other_seed["id"] == task["id"] and other_seed["problem_statement"] != task["problem_statement"]
    other_hint = generate("demo", 1, seed=0, hint="module")[0]  # the same task, its statement naming the module alone
    path = tmp_path / f"{task['id']}.traj.json"
    for kept in (
        trajectory(other_seed),
        trajectory(other_hint),
        trajectory(task, tests_first=False),
        trajectory(task, search=True),
        trajectory(task, exit_status="LimitsExceeded"),
        json.dumps({"trajectory_format": "mini-swe-agent-1.1", "info": {}, "messages": ["not a message"]}),
    ):
        path.write_text(kept)
        recorded(task, tmp_path, tests_first=True)
    assert recordings == [task["id"]] * 6


def test_the_model_is_as_deep_and_wide_as_asked() -> None:
    default = model_spec(0)
    assert (default.layers, default.heads, default.hidden, default.intermediate) == (3, 2, 128, 512)
    deeper = model_spec(0, layers=4, heads=3)
    assert (deeper.layers, deeper.heads, deeper.kv_heads, deeper.hidden, deeper.intermediate) == (4, 3, 3, 192, 768)


def test_a_path_demonstration_is_not_reused_for_a_module_one(tmp_path: Path, recordings: list[str]) -> None:
    """The other direction (the path hint's statement holds more than the module hint's, not it)."""
    module = generate("demo", 1, seed=0, hint="module")[0]
    (tmp_path / f"{module['id']}.traj.json").write_text(trajectory(generate("demo", 1, seed=0, hint="path")[0]))
    recorded(module, tmp_path, tests_first=True)
    assert recordings == [module["id"]]


def test_the_hintless_demonstrations_are_the_last_ones_said_as_held_out_tasks_say_them() -> None:
    rows = generate("demo", 6, seed=0)
    mixed = hintless_tail(rows, 2)
    assert [HINT_SENTENCE.search(r["problem_statement"]) is not None for r in mixed] == [True] * 4 + [False] * 2
    assert [r["problem_statement"] for r in mixed[4:]] == [without_hint(r["problem_statement"]) for r in rows[4:]]
    assert mixed[:4] == rows[:4] and [r["files"] for r in mixed] == [r["files"] for r in rows]  # the same bugs
    assert hintless_tail(rows, 0) == rows and all(HINT_SENTENCE.search(r["problem_statement"]) for r in rows)
    with pytest.raises(ValueError, match="hintless demonstrations: 7 of 6"):
        hintless_tail(rows, 7)


def test_a_hinted_demonstration_is_not_reused_for_a_hintless_one(tmp_path: Path, recordings: list[str]) -> None:
    hinted = generate("demo", 1, seed=0)[0]
    (tmp_path / f"{hinted['id']}.traj.json").write_text(trajectory(hinted))
    (hintless,) = hintless_tail([hinted], 1)
    recorded(hintless, tmp_path, tests_first=True)
    assert recordings == [hinted["id"]]


def test_a_demonstration_that_writes_the_path_is_not_reused_for_one_that_searches(
    tmp_path: Path, recordings: list[str]
) -> None:
    task = generate("demo", 1, seed=0)[0]
    path = tmp_path / f"{task['id']}.traj.json"
    path.write_text(trajectory(task))  # recorded before --locate-demos: no `locate` key means the path
    assert recorded(task, tmp_path, tests_first=True) == path and recordings == []
    recorded(task, tmp_path, tests_first=True, locate=True)
    path.write_text(trajectory(task, locate=True))
    assert recorded(task, tmp_path, tests_first=True, locate=True) == path
    recorded(task, tmp_path, tests_first=True)
    assert recordings == [task["id"]] * 2


def test_the_searching_demonstrations_are_the_last_ones() -> None:
    assert searching_tail(5, 2) == [False, False, False, True, True]
    assert searching_tail(3, 0) == [False] * 3 and searching_tail(3, 3) == [True] * 3
    with pytest.raises(ValueError, match="by a search: 4 of 3"):
        searching_tail(3, 4)


@pytest.mark.parametrize("count", ["-1", "9"])
def test_searching_demonstrations_out_of_range_are_named(count: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--demos", "8", "--openings", "0", "--locate-demos", count])
    assert exited.value.code == 2
    assert f"--locate-demos must be between 0 and --demos (8), got {count}" in capsys.readouterr().err


def test_hintless_demonstrations_that_would_take_an_opening_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--demos", "8", "--openings", "4", "--hintless-demos", "5"])
    assert exited.value.code == 2
    assert "--hintless-demos must be between 0 and --demos less --openings (4), got 5" in capsys.readouterr().err


def test_hintless_demonstrations_without_the_tests_first_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--demos", "8", "--openings", "0", "--hintless-demos", "2", "--no-tests-first"])
    assert exited.value.code == 2 and "--hintless-demos needs --tests-first" in capsys.readouterr().err


def test_an_unknown_demonstration_hint_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--demo-hint", "none"])  # demonstrations always name something: that is the easier case
    assert exited.value.code == 2 and "--demo-hint: invalid choice: 'none'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--layers", "--heads"])
def test_a_shape_out_of_range_is_named(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([flag, "0"])
    assert exited.value.code == 2
    assert f"{flag} must be between 1 and 32, got 0" in capsys.readouterr().err


def test_more_openings_than_demonstrations_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--demos", "8", "--openings", "9"])
    assert exited.value.code == 2
    assert "--openings must be between 0 and --demos (8), got 9" in capsys.readouterr().err


def test_continue_to_without_continue_from_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--continue-to", "elsewhere"])
    assert exited.value.code == 2 and "give --continue-from too" in capsys.readouterr().err


def test_continuing_no_steps_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(tmp_path), "--continue-from", str(tmp_path), "--continue-steps", "0"])
    assert exited.value.code == 2 and "--continue-steps must be >= 1, got 0" in capsys.readouterr().err


def test_continuing_from_what_is_not_a_model_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(tmp_path), "--continue-from", str(tmp_path / "nowhere")])
    assert exited.value.code == 2 and "nowhere: not a saved model (no config.json there)" in capsys.readouterr().err


@pytest.fixture
def saved_start(tmp_path: Path) -> Path:
    """A directory that passes the model check; the errors below come before anything loads it."""
    start = tmp_path / "model-warm-first"
    start.mkdir()
    (start / "config.json").write_text("{}")
    return start


def test_continuing_without_recorded_demonstrations_says_to_prepare(
    tmp_path: Path, saved_start: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(tmp_path), "--continue-from", str(saved_start)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "demo/tasks.jsonl is missing" in err
    assert f"python -m examples.swe_lite.prepare --out {tmp_path}" in err


def test_continuing_onto_its_own_start_is_refused(tmp_path: Path, saved_start: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(tmp_path), "--continue-from", str(saved_start), "--continue-to", str(saved_start / ".")])
    assert exited.value.code == 2 and "would overwrite its start" in capsys.readouterr().err


def test_continuing_with_a_demonstration_missing_names_it(
    tmp_path: Path, saved_start: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tasks = generate("demo", 2, seed=0)
    write_tasks(tasks, tmp_path / "demo")
    (tmp_path / "demos").mkdir()
    (tmp_path / "demos" / f"{tasks[0]['id']}.traj.json").write_text(trajectory(tasks[0]))
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(tmp_path), "--continue-from", str(saved_start)])
    assert exited.value.code == 2 and f"{tasks[1]['id']}.traj.json" in capsys.readouterr().err
