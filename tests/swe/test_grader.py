"""The SWE example's test-based grader: 0.0 on each shipped (broken) repo, 1.0 once the task's
reference patch is applied, tests restored before grading, and clear errors for bad tasks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.swe.grader import grade
from examples.swe.swe_task import TaskError, fresh_copy, parse_task

ROOT = Path(__file__).resolve().parents[2]
TASKS = [json.loads(line) for line in (ROOT / "examples/swe/tasks.jsonl").read_text().splitlines() if line.strip()]


def apply_patch(workspace: Path, patch: str) -> None:
    subprocess.run(["git", "apply", "-p1", "-"], input=patch.encode(), cwd=workspace, check=True)


@pytest.mark.parametrize("raw", TASKS, ids=[t["id"] for t in TASKS])
def test_broken_repo_scores_0_and_the_reference_fix_scores_1(raw: dict, tmp_path: Path) -> None:
    task = parse_task(raw)
    workspace = fresh_copy(task, tmp_path / "ws")
    assert grade(task, workspace) == 0.0
    apply_patch(workspace, raw["patch"])
    assert grade(task, workspace) == 1.0


def test_pass_to_pass_counts_too(tmp_path: Path) -> None:
    """A 'fix' that breaks a PASS_TO_PASS test is not a fix."""
    raw = next(t for t in TASKS if t["id"] == "calc-mean")
    task = parse_task(raw)
    workspace = fresh_copy(task, tmp_path / "ws")
    apply_patch(workspace, raw["patch"])
    source = workspace / "calc.py"
    source.write_text(source.read_text().replace("return sum(values)", "return 0"))
    assert grade(task, workspace) == 0.0


def test_edited_tests_are_restored_before_grading(tmp_path: Path) -> None:
    task = parse_task(TASKS[0])
    workspace = fresh_copy(task, tmp_path / "ws")
    for name in task.test_files:
        (workspace / name).write_text("def test_mean():\n    pass\n")
    assert grade(task, workspace) == 0.0


def test_without_plugin_autoload_a_test_that_needs_a_plugin_fails(tmp_path: Path) -> None:
    """--no-plugin-autoload is for tests that need no third-party plugin: one that uses a plugin's fixture
    (anyio's `anyio_backend`, installed with httpx) passes with the plugins and errors without them."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests/test_plugin.py").write_text("def test_backend(anyio_backend):\n    assert anyio_backend\n")
    raw = {"id": "plugin", "repo": str(repo), "problem_statement": "-",
           "FAIL_TO_PASS": ["tests/test_plugin.py::test_backend"], "PASS_TO_PASS": []}  # fmt: skip
    task = parse_task(raw)
    workspace = fresh_copy(task, tmp_path / "ws")
    assert grade(task, workspace) == 1.0
    assert grade(task, workspace, plugin_autoload=False) == 0.0
    env = {**os.environ, "AGL_TASK": json.dumps(raw)}
    for flag, reward in (("--plugin-autoload", "1.0"), ("--no-plugin-autoload", "0.0")):
        result = subprocess.run([sys.executable, str(ROOT / "examples/swe/grader.py"), "--workspace", str(workspace), flag],
                                env=env, capture_output=True, text=True, check=False)  # fmt: skip
        assert result.returncode == 0 and result.stdout.strip().splitlines()[-1] == reward, result.stderr


def test_grader_as_the_runner_runs_it(tmp_path: Path) -> None:
    """AGL_TASK and AGL_ROLLOUT_ID from the environment, the reward on the last stdout line, the
    rollout's workspace removed afterwards."""
    raw = TASKS[1]
    workspace = fresh_copy(parse_task(raw), tmp_path / "r-1")
    apply_patch(workspace, raw["patch"])
    env = {**os.environ, "AGL_TASK": json.dumps(raw), "AGL_ROLLOUT_ID": "r-1", "AGL_SWE_WORKDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, str(ROOT / "examples/swe/grader.py")], env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "1.0"
    assert not workspace.exists()


def test_grader_errors_name_the_problem(tmp_path: Path) -> None:
    script = str(ROOT / "examples/swe/grader.py")
    env = {**os.environ, "AGL_ROLLOUT_ID": "nope", "AGL_SWE_WORKDIR": str(tmp_path), "AGL_TASK": json.dumps(TASKS[0])}
    missing = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, check=False)
    assert missing.returncode == 2 and "workspace" in missing.stderr and "does not exist" in missing.stderr
    bad_id = {**TASKS[0], "FAIL_TO_PASS": ["tests/test_calc.py::test_no_such_test"]}
    fresh_copy(parse_task(bad_id), tmp_path / "ws")
    env["AGL_TASK"] = json.dumps(bad_id)
    result = subprocess.run([sys.executable, script, "--workspace", str(tmp_path / "ws")], env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 2 and "pytest exited 4" in result.stderr


def test_a_patch_that_stops_the_tests_from_running_scores_0_not_a_task_error(tmp_path: Path) -> None:
    """A module that no longer imports makes pytest exit 4 ("found no collectors"): the patch's fault,
    since the task's own repo collects the tests; a test that hangs past the timeout also scores 0.0.
    Neither may vanish as a harness error (a dropped rollout would spare a breaking patch its 0.0)."""
    raw = next(t for t in TASKS if t["id"] == "calc-mean")
    task = parse_task(raw)
    workspace = fresh_copy(task, tmp_path / "ws")
    (workspace / "calc.py").write_text("def mean(values:\n")  # a syntax error
    assert grade(task, workspace) == 0.0
    env = {**os.environ, "AGL_TASK": json.dumps(raw)}
    script = str(ROOT / "examples/swe/grader.py")
    result = subprocess.run([sys.executable, script, "--workspace", str(workspace)], env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0 and result.stdout.strip().splitlines()[-1] == "0.0"
    assert "do not run in the patched workspace" in result.stderr
    (workspace / "calc.py").write_text("import time\ntime.sleep(60)\n")  # hangs on import
    result = subprocess.run([sys.executable, script, "--workspace", str(workspace), "--timeout-s", "2"], env=env,
                            capture_output=True, text=True, check=False)  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip().splitlines()[-1] == "0.0"
    assert "did not finish within 2 s" in result.stderr


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"FAIL_TO_PASS": []}, "at least one test must fail"),
        ({"FAIL_TO_PASS": "tests/x.py::t"}, "expected a list of pytest test ids"),
        ({"PASS_TO_PASS": ["../outside.py::t"]}, "must name a test inside the repo"),
        ({"repo": "repos/none"}, "is not a directory"),
        ({"problem_statement": ""}, "'problem_statement': expected a non-empty string"),
    ],
)
def test_bad_tasks_are_refused(change: dict, message: str) -> None:
    with pytest.raises(TaskError, match=message):
        parse_task({**TASKS[0], **change})


def run_grader(raw: dict, workspace: Path, *options: str, log: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "AGL_ROLLOUT_LOG"}
    env["AGL_TASK"] = json.dumps(raw)
    if log is not None:
        env["AGL_ROLLOUT_LOG"] = str(log)  # as the runner sets it
    command = [sys.executable, str(ROOT / "examples/swe/grader.py"), "--workspace", str(workspace), *options]
    return subprocess.run(command, env=env, capture_output=True, text=True, check=False)


# What a rollout's log holds: mini-swe-agent's banner, harness.py's outcome line, then whatever the SDK
# or the interpreter writes after it. The outcome may be spelled with other spacing or key order.
LOG_AROUND = "This is mini-swe-agent version 2.4.6.\nLoading global config from '/root/.env'\n{}\n{{not json\n"


@pytest.mark.parametrize(
    ("outcome", "reward"),
    [
        ('{"task": "calc-mean", "exit_status": "Submitted", "steps": 4}', "1.0"),
        ('{ "steps":4,"exit_status" : "Submitted" }', "1.0"),
        ('{"task": "calc-mean", "exit_status": "LimitsExceeded", "steps": 6}', "0.0"),
        ('{"exit_status": "ContextWindowExceeded"}', "0.0"),
    ],
)
def test_require_submission_scores_only_a_submitted_run(outcome: str, reward: str, tmp_path: Path) -> None:
    """The copy is fixed either way: with --require-submission, a run that did not end with the submit
    command scores 0.0 (SWE-bench's "no submission"), read from the harness's outcome line in the log."""
    raw = next(t for t in TASKS if t["id"] == "calc-mean")
    workspace = fresh_copy(parse_task(raw), tmp_path / "ws")
    apply_patch(workspace, raw["patch"])
    log = tmp_path / "rollout.log"
    log.write_text(LOG_AROUND.format(outcome))
    result = run_grader(raw, workspace, "--require-submission", log=log)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == reward
    if reward == "0.0":
        assert "did not submit (exit status" in result.stderr
    unrequired = run_grader(raw, workspace, log=log)  # without the option the fixed copy passes however it ended
    assert unrequired.stdout.strip().splitlines()[-1] == "1.0"


def test_require_submission_without_an_outcome_names_the_fix(tmp_path: Path) -> None:
    raw = TASKS[0]
    workspace = fresh_copy(parse_task(raw), tmp_path / "ws")
    no_log = run_grader(raw, workspace, "--require-submission")
    assert no_log.returncode == 2 and "AGL_ROLLOUT_LOG" in no_log.stderr and "--harness-log" in no_log.stderr
    log = tmp_path / "rollout.log"
    log.write_text("Traceback (most recent call last):\n{\"task\": \"x\"}\n")
    no_outcome = run_grader(raw, workspace, "--require-submission", "--harness-log", str(log))
    assert no_outcome.returncode == 2 and "no outcome line" in no_outcome.stderr
    missing = run_grader(raw, workspace, "--require-submission", "--harness-log", str(tmp_path / "absent.log"))
    assert missing.returncode == 2 and "cannot read the harness's log" in missing.stderr
    assert "Traceback" not in no_log.stderr + no_outcome.stderr + missing.stderr
