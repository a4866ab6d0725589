"""swe-lite's task generator: reproducible tasks whose bug breaks exactly its FAIL_TO_PASS tests (checked
with real pytest through examples/swe's grader), every bug family, and two held-out splits (val to
choose on, test to report) that share nothing the model sees with training (and a check that would say so if the
generator leaked), test's tasks other than val's."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import examples.swe_lite.generate as generate_module
from examples.swe.grader import grade
from examples.swe.swe_task import fresh_copy, parse_task
from examples.swe_lite.functions import FAMILIES, FUNCTIONS
from examples.swe_lite.generate import (
    GenerationError, cases, generate, outcome, overlap, render, without_hint, write_tasks,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_same_seed_gives_the_same_tasks_and_another_seed_others() -> None:
    assert generate("train", 50, seed=3) == generate("train", 50, seed=3)
    first, other = generate("train", 50, seed=3), generate("train", 50, seed=4)
    assert [t["problem_statement"] for t in first] != [t["problem_statement"] for t in other]


def test_thousands_of_distinct_training_tasks_cover_every_bug_family() -> None:
    tasks = generate("train", 2000, seed=0)
    assert len({json.dumps(t["files"], sort_keys=True) for t in tasks}) == 2000
    assert set(collections.Counter(t["placement"]["family"] for t in tasks)) == set(FAMILIES)


@pytest.mark.parametrize("function", FUNCTIONS, ids=[f.name for f in FUNCTIONS])
def test_each_bug_is_one_snippet_and_breaks_a_call(function) -> None:
    from examples.swe_lite.generate import Module

    values = {k: v[0] for k, v in function.constants.items()}
    module = Module("m", ((function, values),))
    expected = {c.call: c.expected for c in cases([module])}
    for bug in function.bugs:
        broken = module.source((function.name, bug))  # raises GenerationError unless the snippet is unique
        assert render(bug.buggy, values) in broken
        assert any(outcome(broken, call) != ("value", value) for call, value in expected.items()), bug


@pytest.mark.parametrize("split", generate_module.HELD_OUT)
def test_each_held_out_split_shares_nothing_the_model_sees_with_training(split: str) -> None:
    train, held_out = generate("train", 2000, seed=0), generate(split, 200, seed=0)
    assert overlap(train, held_out) == []


def test_the_test_split_is_other_tasks_than_the_val_split_settings_are_chosen_on() -> None:
    """Choosing on val and reporting on test means test's tasks are not val's: no repository, statement or
    bug placement in common (names may meet by chance: both come from the held-out half of the space)."""
    val, test = generate("val", 200, seed=0), generate("test", 200, seed=0)
    shared = {key.split(":")[0] for key in overlap(val, test)}
    assert shared <= {"name"}
    assert not {json.dumps(t["files"], sort_keys=True) for t in val} & {json.dumps(t["files"], sort_keys=True) for t in test}


def test_the_disjointness_check_fails_when_the_generator_leaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Held-out tasks drawn from training's half of the name space: the check must find the names they share."""
    monkeypatch.setitem(generate_module.BUCKETS, "test", generate_module.BUCKETS["train"])
    leaked = overlap(generate("train", 2000, seed=0), generate("test", 200, seed=0))
    assert any(key.startswith("name:") for key in leaked)
    monkeypatch.undo()  # test's own names again, but val's draws: the same tasks
    monkeypatch.setitem(generate_module.SPLIT_SALT, "test", generate_module.SPLIT_SALT["val"])
    same = overlap(generate("val", 50, seed=0), generate("test", 50, seed=0))
    assert {key.split(":")[0] for key in same} >= {"statement", "placement", "file", "name"}


def test_names_are_made_up_afresh_and_held_out_ones_never_train() -> None:
    """Names a model cannot learn by heart: few repeat across 2000 repositories; no held-out name in
    training or the demonstrations; none shadows a module Python has."""
    def names(tasks: list[dict]) -> list[str]:
        return [name for task in tasks for name in generate_module.repository_names(task)]

    task = generate("train", 1, seed=0)[0]  # a package and a module per test file
    tested = sorted(p.removeprefix("tests/test_").removesuffix(".py") for p in task["files"] if p.startswith("tests/"))
    assert names([task])[0] == task["placement"]["package"] and sorted(names([task])[1:]) == tested
    train, demo = names(generate("train", 2000, seed=0)), names(generate("demo", 256, seed=0))
    heldout = names(generate("val", 200, seed=0)) + names(generate("test", 200, seed=0))
    assert len(set(train)) > 0.5 * len(train)  # a fixed pool of names would repeat each hundreds of times
    assert not set(heldout) & (set(train) | set(demo))
    assert {generate_module.name_bucket(n) for n in heldout} == {0} and 0 not in {generate_module.name_bucket(n) for n in train + demo}
    assert not set(train + demo + heldout) & (set(sys.stdlib_module_names) | {"tests", "conftest"})


def test_the_statement_names_the_file_only_in_demonstrations() -> None:
    ask = " Find the function, fix the bug, run the tests."
    for task in generate("demo", 20, seed=0, hint="path"):
        hint = f" The bug is in {task['fix']['path']}."
        assert task["problem_statement"].endswith(hint + ask)  # the one sentence more, worded as the rest
    assert generate("demo", 20, seed=0) == generate("demo", 20, seed=0, hint="module")  # the default
    for task in generate("demo", 20, seed=0, hint="module"):
        module = task["placement"]["module"]
        assert task["problem_statement"].endswith(f" The bug is in {module}.py." + ask)
        assert f"{task['placement']['package']}/" not in task["problem_statement"]  # the package only as its first words
    for task in generate("train", 20, seed=0) + generate("val", 20, seed=0) + generate("test", 20, seed=0):
        assert task["fix"]["path"] not in task["problem_statement"] and task["problem_statement"].endswith(ask)
        assert "The bug is in" not in task["problem_statement"]


def one_task_per_family(tmp_path: Path) -> list[dict]:
    chosen = {}
    for task in generate("train", 200, seed=1):
        chosen.setdefault(task["placement"]["family"], task)
    write_tasks(list(chosen.values()), tmp_path / "tasks")
    return [json.loads(line) for line in (tmp_path / "tasks" / "tasks.jsonl").read_text().splitlines()]


def test_pytest_fails_the_bug_and_passes_the_fix(tmp_path: Path) -> None:
    rows = one_task_per_family(tmp_path)
    assert len(rows) == len(FAMILIES)
    for row in rows:
        task = parse_task(row)
        workspace = fresh_copy(task, tmp_path / "ws" / row["id"])
        # the config grades without third-party pytest plugins: the generated tests need none, the same rewards
        assert grade(task, workspace) == grade(task, workspace, plugin_autoload=False) == 0.0, row["placement"]
        fix = workspace / row["fix"]["path"]
        fix.write_text(fix.read_text().replace(row["fix"]["buggy"], row["fix"]["correct"]))
        assert grade(task, workspace) == grade(task, workspace, plugin_autoload=False) == 1.0, row["placement"]


@pytest.mark.parametrize("edit", ["change", "add", "remove", "conftest"])
def test_the_grader_refuses_a_patch_that_edits_the_tests(tmp_path: Path, edit: str) -> None:
    row = one_task_per_family(tmp_path)[0]
    task = parse_task(row)
    workspace = fresh_copy(task, tmp_path / "r-1")
    fix = workspace / row["fix"]["path"]
    fix.write_text(fix.read_text().replace(row["fix"]["buggy"], row["fix"]["correct"]))
    test = workspace / task.test_files[0]
    if edit == "change":
        test.write_text(test.read_text() + "\n# edited\n")
    elif edit == "add":
        (workspace / "tests" / "test_extra.py").write_text("def test_x():\n    pass\n")
    elif edit == "remove":
        test.unlink()
    else:
        (workspace / "conftest.py").write_text("collect_ignore = ['tests']\n")
    env = {**os.environ, "AGL_TASK": json.dumps(row), "AGL_ROLLOUT_ID": "r-1", "AGL_SWE_WORKDIR": str(tmp_path)}
    grader = [sys.executable, str(ROOT / "examples/swe/grader.py"), "--refuse-test-edits", "--keep"]
    result = subprocess.run(grader, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0 and result.stdout.strip().splitlines()[-1] == "0.0", result.stderr
    assert "refused, the patch edits the tests" in result.stderr
    assert grade(task, workspace) == 1.0  # without the flag the tests are restored and the fix passes


def test_a_fix_that_leaves_the_tests_alone_is_not_refused(tmp_path: Path) -> None:
    row = one_task_per_family(tmp_path)[0]
    task = parse_task(row)
    workspace = fresh_copy(task, tmp_path / "ws")
    fix = workspace / row["fix"]["path"]
    fix.write_text(fix.read_text().replace(row["fix"]["buggy"], row["fix"]["correct"]))
    for left in ("tests/__pycache__/test_x.cpython-311.pyc", ".pytest_cache/v/cache/lastfailed"):
        (workspace / left).parent.mkdir(parents=True, exist_ok=True)  # what running the tests leaves behind
        (workspace / left).write_text("x")
    assert grade(task, workspace, refuse_test_edits=True) == 1.0


def test_a_hint_changes_the_statement_only() -> None:
    """The same draws whatever the hint: a warm start on `module` demonstrations and one on `path` ones
    differ in one sentence of each statement, nothing else."""
    by_hint = {hint: generate("demo", 30, seed=2, hint=hint) for hint in ("none", "path", "module")}
    for none, path, module in zip(*by_hint.values()):
        assert {k: v for k, v in path.items() if k != "problem_statement"} == {k: v for k, v in none.items() if k != "problem_statement"}
        assert {k: v for k, v in module.items() if k != "problem_statement"} == {k: v for k, v in none.items() if k != "problem_statement"}
        assert len({none["problem_statement"], path["problem_statement"], module["problem_statement"]}) == 3
    assert generate("val", 5, seed=2, hint="module") != generate("val", 5, seed=2)  # held-out splits can take one too


def test_bad_generator_input_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(GenerationError, match="split 'nope'"):
        generate("nope", 1, seed=0)
    with pytest.raises(GenerationError, match=r"hint 'file': expected one of \('none', 'path', 'module'\)"):
        generate("demo", 1, seed=0, hint="file")
    with pytest.raises(SystemExit):
        generate_module.main(["--out", "x", "--hint", "file"])
    assert "invalid choice: 'file'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate_module.main(["--out", "x", "--count", "0"])
    assert "--count must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("hint", ["module", "path"])
def test_without_its_hint_a_statement_is_the_bare_one_of_the_same_draw(hint: str) -> None:
    hinted, bare = generate("demo", 12, seed=4, hint=hint), generate("demo", 12, seed=4, hint="none")
    assert all("The bug is in" in t["problem_statement"] for t in hinted)
    assert [without_hint(t["problem_statement"]) for t in hinted] == [t["problem_statement"] for t in bare]


@pytest.mark.parametrize(
    "statement",
    [
        "In tota, f(1) returns 2 but it should return 3. Find the function, fix the bug, run the tests.",  # none
        "In tota, f(1) returns 2. The bug is in nesodi.py. Run it.",  # not before the statement's last sentence
    ],
)
def test_a_statement_without_a_hint_sentence_is_refused(statement: str) -> None:
    with pytest.raises(ValueError, match="no hint sentence"):
        without_hint(statement)
