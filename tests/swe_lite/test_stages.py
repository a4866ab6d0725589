"""examples/swe_lite/stages.py: each rollout's commands sorted into the stages of its task's fix.
The counts from a real run's store are checked in test_end_to_end.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples.swe_lite.demonstrations import fix_expression, replies
from examples.swe_lite.generate import generate
from examples.swe_lite.stages import RunStages, column_names, commands, main, same_tokenizer, served_model, stages, table

TASK = generate("train", 1, seed=5)[0]
PATH = TASK["fix"]["path"]


def test_the_scripted_policy_reaches_every_stage_and_without_a_fix_only_reading() -> None:
    solved = commands(replies(TASK, tests_first=True))
    assert stages(TASK, solved, 1.0) == {"tests", "read_right", "read_package", "read_module", "edited_right", "fix", "passed", "submitted", "submitted_passed"}
    unfixed = commands(replies(TASK, fix=False))
    assert stages(TASK, unfixed, 0.0) == {"tests", "read_right", "read_package", "read_module", "submitted", "submitted_unpassed"}
    assert stages(TASK, unfixed[:-1], 0.0) == {"tests", "read_right", "read_package", "read_module"}  # ran out of steps
    assert "submitted" not in stages(TASK, ["echo COMPLETE_TASK_AND_SUBMIT", "echo done COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"], 0.0)
    assert "submitted_passed" not in stages(TASK, solved[:-1], 1.0)  # fixed, then cut off before submitting


def test_paths_and_quoting_spelled_differently_count_the_same() -> None:
    fix = fix_expression(TASK)
    run = [f"cat  ./{PATH}", f'sed -i "{fix}" {PATH.replace("/", "//")}']
    assert stages(TASK, run, 0.0) == {"read_right", "read_package", "read_module", "edited_right", "fix"}


def test_a_search_for_the_function_names_its_file_however_quoted() -> None:
    solved = commands(replies(TASK, tests_first=True, locate=True))
    assert stages(TASK, solved, 1.0) == {
        "tests", "searched", "read_right", "read_package", "read_module", "edited_right", "fix", "passed", "submitted",
        "submitted_passed",
    }  # fmt: skip
    function = TASK["placement"]["function"]
    spelled = [f"cat $( grep -rl 'def {function}(' . )", f"sed -i \"{fix_expression(TASK)}\" $(grep -l -r def\\ {function}\\( .)"]
    assert stages(TASK, spelled, 0.0) == {"searched", "read_right", "read_package", "read_module", "edited_right", "fix"}
    other = [f'cat $(grep -rl "def {function}x(" .)', f"sed -i '{fix_expression(TASK)}' $(grep -rl \"def other(\" .)"]
    assert stages(TASK, other, 0.0) == {"read_other_only"}  # another function's file: not the bug's


def test_a_path_copied_wrong_reads_another_file_and_edits_nothing() -> None:
    wrong = PATH[:-4] + "x.py"
    run = [f"cat {wrong}", f"sed -i '{fix_expression(TASK)}' {wrong}", "sed -i 's/a/b/", "cat"]
    assert stages(TASK, run, 0.0) == {"read_other_only", "read_package"}  # an unclosed quote, a bare cat: nothing


def test_a_path_half_copied_right_counts_for_that_half() -> None:
    package, module = PATH.split("/")
    assert stages(TASK, [f"cat x{package}/{module}"], 0.0) == {"read_other_only", "read_module"}
    assert stages(TASK, [f"cat {module}"], 0.0) == {"read_other_only", "read_module"}  # no package at all
    assert stages(TASK, [f"cat ./{package}//x{module}"], 0.0) == {"read_other_only", "read_package"}
    assert stages(TASK, [f"cat {package}/{module[:-3]}.txt"], 0.0) == set()  # not a .py file: not a read


def test_replies_with_no_or_two_commands_are_not_run() -> None:
    one = "THOUGHT: t\n\n```mswea_bash_command\nls\n```"
    assert commands([one, "THOUGHT: no block", one + "\n" + one]) == ["ls"]


def test_the_table_counts_each_stage_and_each_family() -> None:
    run = RunStages("r")
    run.add(TASK, {"tests", "passed"})
    run.add(TASK, {"tests"})
    rows = {line.rsplit("  ", 1)[0].strip(): line.rsplit("  ", 1)[1] for line in table([run]).splitlines()}
    assert rows["rollouts"] == "2" and rows["ran the tests"] == "2 (100%)" and rows["read the right file"] == "0 (0%)"
    assert rows["passed (reward 1.0)"] == "1 (50%)" and rows[f"passed, {TASK['placement']['family']}"] == "1/2"


def test_bad_arguments_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "x", "problem_statement": "p"}) + "\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    with pytest.raises(SystemExit, match="tasks.jsonl:1 is not a swe-lite task"):
        main([str(tmp_path), "--tasks", str(tasks), "--model", str(model)])
    tasks.write_text(json.dumps(TASK) + "\n")
    for argv, named in [([str(tmp_path), "--tasks", str(tmp_path / "missing.jsonl")], "missing.jsonl: no such file"),
                        ([str(tmp_path), "--tasks", str(tasks)], "has no rollouts.db"),
                        ([str(tmp_path / "run"), "--tasks", str(tasks)], "no tokenizer loads from it")]:  # fmt: skip
        (tmp_path / "run").mkdir(exist_ok=True)
        (tmp_path / "run" / "rollouts.db").touch()
        with pytest.raises(SystemExit):
            main([*argv, "--model", str(model)])
        assert named in capsys.readouterr().err


def test_each_run_decodes_with_the_model_it_served(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """prepare trains a vocabulary a seed: a run read with another seed's tokenizer would count other text."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(TASK) + "\n")
    models = {}
    for name, vocabulary in (("seed0", '{"v": 0}'), ("seed0-copy", '{"v": 0}'), ("seed2", '{"v": 2}')):
        models[name] = tmp_path / name
        models[name].mkdir()
        (models[name] / "tokenizer.json").write_text(vocabulary)
    evaluated, trained, unknown = (tmp_path / "runs" / name for name in ("eval", "rl", "unknown"))
    for run in (evaluated, trained, unknown):
        run.mkdir(parents=True)
        (run / "rollouts.db").touch()
    (evaluated / "receipt.json").write_text(json.dumps({"model": {"path": str(models["seed0"])}}))
    (trained / "config.yaml").write_text(f"model:\n  path: {models['seed2']}\n")
    (unknown / "config.yaml").write_text("model: [not, a, mapping]\n")
    assert served_model(evaluated) == models["seed0"] and served_model(trained) == models["seed2"]
    relative = tmp_path / "runs" / "rl-relative"  # agl train run from tmp_path with a relative model.path
    relative.mkdir()
    (relative / "config.yaml").write_text("output_dir: runs/rl-relative\nmodel:\n  path: seed2\n")
    assert served_model(relative) is not None and served_model(relative).resolve() == models["seed2"].resolve()
    assert served_model(unknown) is None
    (unknown / "receipt.json").write_text("[" * 100_000 + "]" * 100_000)  # nested past the JSON parser's recursion
    assert served_model(unknown) is None
    assert same_tokenizer(models["seed0"], models["seed0-copy"]) and not same_tokenizer(models["seed0"], models["seed2"])
    for argv, named in [
        ([str(trained), "--model", str(models["seed0"])], f"{trained} served {models['seed2']}, whose tokenizer differs"),
        ([str(unknown)], f"{unknown}: its receipt.json / config.yaml name no model directory found here (fix: pass --model"),
        ([str(evaluated)], f"{models['seed0']}: no tokenizer loads from it"),  # its own model, read (a fake vocabulary)
        ([str(evaluated), "--model", str(models["seed0-copy"])], f"{models['seed0-copy']}: no tokenizer loads from it"),
    ]:
        with pytest.raises(SystemExit):
            main([*argv, "--tasks", str(tasks)])
        assert named in capsys.readouterr().err


def test_runs_of_the_same_name_are_told_apart_by_their_parent() -> None:
    runs = [Path("runs/s0/eval-warm-val"), Path("runs/s2/eval-warm-val"), Path("runs/s2/eval-rl-val")]
    assert column_names(runs) == ["s0/eval-warm-val", "s2/eval-warm-val", "eval-rl-val"]
