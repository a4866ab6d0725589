"""The test-based grader (harness.grader): after the agent finished, run the task's FAIL_TO_PASS and
PASS_TO_PASS tests in the rollout's workspace and print the reward on the last stdout line.

    AGL_TASK='{...}' AGL_ROLLOUT_ID=r1 python examples/swe/grader.py      # the runner sets both
    python examples/swe/grader.py --task-json '{...}' --workspace DIR     # by hand

Reward 1.0 when every listed test passes, else 0.0 (SWE-bench's "resolved"). The test files are
restored from the task's repo first, so editing a test does not pass it; with `--refuse-test-edits`
a workspace whose tests differ from the task's (a graded test file, anything under `tests/`, a
`test_*.py`, pytest's config or a conftest.py: changed, added or removed) gets 0.0 without running.
Tests that do not finish within `--timeout-s` score 0.0, and so do tests pytest cannot collect in
the patched workspace (a module that no longer imports) when it collects them in a fresh copy of the
task's repo; when it cannot collect them there either (a test id that does not exist), that is the
task's fault: exit 2 with the message, no reward. `--no-plugin-autoload` runs pytest without the
environment's third-party plugins (PYTEST_DISABLE_PLUGIN_AUTOLOAD): for tasks whose tests need none,
where loading them is most of a run's time (3.5 s of 3.7 in this venv); a repository whose tests use
a plugin's fixtures needs them.

`--require-submission` scores only a run that ended with the agent's submit command (mini-swe-agent's
exit status `Submitted`), as SWE-bench does: a run cut off by its step limit submitted no patch, so it
resolves nothing even when the copy's tests happen to pass. The grader reads the exit status from
harness.py's outcome line (a JSON object with `exit_status`) in the rollout's log, which the runner
passes as $AGL_ROLLOUT_LOG (or `--harness-log FILE`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.swe.swe_task import SUBMITTED, SweTask, TaskError, fresh_copy, parse_task, workspace_for

PYTEST_PASSED, PYTEST_FAILED = 0, 1
PYTEST_CONFIG = frozenset({"conftest.py", "pytest.ini", "setup.cfg", "tox.ini", "pyproject.toml"})
NOT_SOURCE = frozenset({"__pycache__", ".pytest_cache"})  # what running the tests leaves behind


class GraderError(ValueError):
    """The grader cannot score this rollout as configured; the message names the fix."""


def harness_exit_status(log: Path | None) -> str:
    """The exit status on the harness's outcome line: the last line of the rollout's log that is a JSON
    object with an `exit_status` (harness.py prints it to stdout when the agent is done; mini-swe-agent
    and the SDK write around it, so the line is searched for, not assumed last)."""
    if log is None:
        raise GraderError(
            "--require-submission needs the harness's log: the runner passes it as AGL_ROLLOUT_LOG when it keeps "
            "rollout logs; by hand, pass --harness-log FILE"
        )
    try:
        text = log.read_text(errors="replace")
    except OSError as error:
        raise GraderError(f"--require-submission: cannot read the harness's log {log}: {error.strerror}") from None
    for line in reversed(text.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            outcome = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(outcome, dict) and "exit_status" in outcome:
            return str(outcome["exit_status"])
    raise GraderError(
        f"--require-submission: no outcome line (a JSON object with exit_status) in the harness's log {log}: "
        "is the harness examples/swe/harness.py?"
    )


def is_test_path(task: SweTask, relative: Path) -> bool:
    return (
        relative.as_posix() in task.test_files
        or relative.parts[0] == "tests"
        or relative.name.startswith("test_")
        or relative.name in PYTEST_CONFIG
    )


def edited_tests(task: SweTask, workspace: Path) -> list[str]:
    """The test files (is_test_path) that differ between the task's repo and `workspace`: changed,
    added or removed."""

    def tests_in(root: Path) -> dict[str, bytes]:
        files = {}
        for path in root.rglob("*"):
            relative = path.relative_to(root)
            if path.is_file() and not NOT_SOURCE.intersection(relative.parts) and is_test_path(task, relative):
                files[relative.as_posix()] = path.read_bytes()
        return files

    original, current = tests_in(task.repo), tests_in(workspace)
    return sorted(name for name in original.keys() | current.keys() if original.get(name) != current.get(name))


def grade(
    task: SweTask, workspace: Path, timeout_s: float = 300.0, refuse_test_edits: bool = False, plugin_autoload: bool = True
) -> float:
    """1.0 if all of the task's tests pass in `workspace`, 0.0 if any fails (or, with
    `refuse_test_edits`, if the workspace's tests were edited). `plugin_autoload=False`: pytest
    without the environment's third-party plugins."""
    if not workspace.is_dir():
        raise TaskError(f"workspace {workspace} does not exist (did the harness run?)")
    if refuse_test_edits and (edited := edited_tests(task, workspace)):
        sys.stderr.write(f"grader: refused, the patch edits the tests ({', '.join(edited)}): reward 0.0\n")
        return 0.0
    for name in task.test_files:
        original = task.repo / name
        if not original.is_file():
            raise TaskError(f"task {task.id}: test file {name} is not in {task.repo}")
        target = workspace / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(original, target)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # the grader's settings only
    if not plugin_autoload:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    try:
        result = run_pytest(workspace, task.tests, env, timeout_s)
    except subprocess.TimeoutExpired:  # the patched code hangs (or is that slow): not resolved
        sys.stderr.write(f"grader: the tests did not finish within {timeout_s:g} s: reward 0.0\n")
        return 0.0
    sys.stderr.write(result.stdout[-4000:])
    if result.returncode == PYTEST_PASSED:
        return 1.0
    if result.returncode == PYTEST_FAILED:
        return 0.0
    # Not a test result: pytest could not collect the tests. The task's fault if its own repository does not
    # collect them either (a missing test id); the patch's if it does (e.g. a module that no longer imports).
    if collects(task, env, timeout_s):
        sys.stderr.write(
            f"grader: pytest exited {result.returncode}: the tests do not run in the patched workspace but do in the "
            f"task's repo: reward 0.0\n{(result.stdout + result.stderr)[-2000:]}\n"
        )
        return 0.0
    raise TaskError(
        f"task {task.id}: pytest exited {result.returncode} (not a test result: a missing test id?):\n"
        f"{(result.stdout + result.stderr)[-2000:]}"
    )


def run_pytest(
    root: Path, tests: list[str], env: dict[str, str], timeout_s: float, *options: str
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(root), *options, *tests]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)


def collects(task: SweTask, env: dict[str, str], timeout_s: float) -> bool:
    """Whether pytest collects the task's tests in a fresh copy of the task's own repository."""
    with tempfile.TemporaryDirectory(prefix="agl-grader-") as scratch:
        pristine = fresh_copy(task, Path(scratch) / "repo")
        try:
            return run_pytest(pristine, task.tests, env, timeout_s, "--collect-only").returncode == PYTEST_PASSED
        except subprocess.TimeoutExpired:
            return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task-json", default=os.environ.get("AGL_TASK"), help="the task (default: $AGL_TASK)")
    parser.add_argument("--workspace", help="the repo copy to grade (default: the rollout's, from $AGL_ROLLOUT_ID)")
    parser.add_argument("--keep", action="store_true", default=os.environ.get("AGL_SWE_KEEP") == "1",
                        help="keep the workspace (default: removed after grading; AGL_SWE_KEEP=1)")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--refuse-test-edits", action="store_true",
                        help="0.0 when the workspace's tests differ from the task's (default: restore them and run)")
    parser.add_argument("--require-submission", action="store_true",
                        help="0.0 unless the agent submitted (exit status Submitted), as SWE-bench scores a run cut "
                        "off by its step limit (default: grade the copy however the run ended)")
    parser.add_argument("--harness-log", type=Path, default=os.environ.get("AGL_ROLLOUT_LOG"),
                        help="the rollout's log with the harness's outcome line, for --require-submission (default: "
                        "$AGL_ROLLOUT_LOG, which the runner sets)")
    parser.add_argument("--plugin-autoload", action=argparse.BooleanOptionalAction, default=True,
                        help="load the environment's third-party pytest plugins (default); --no-plugin-autoload for "
                        "tests that need none: most of a short run's time goes to loading them")
    args = parser.parse_args(argv)
    try:
        if not args.task_json:
            raise TaskError("no task: set AGL_TASK (the runner does) or pass --task-json")
        task = parse_task(json.loads(args.task_json))
        rollout_id = os.environ.get("AGL_ROLLOUT_ID", "")
        if not args.workspace and not rollout_id:
            raise TaskError("no workspace: pass --workspace or set AGL_ROLLOUT_ID (the runner does)")
        workspace = Path(args.workspace) if args.workspace else workspace_for(rollout_id)
        status = harness_exit_status(args.harness_log) if args.require_submission else SUBMITTED
        if status != SUBMITTED:
            sys.stderr.write(f"grader: the agent did not submit (exit status {status}): reward 0.0\n")
            reward = 0.0
        else:
            reward = grade(task, workspace, args.timeout_s, args.refuse_test_edits, args.plugin_autoload)
    except (TaskError, GraderError, json.JSONDecodeError) as error:
        print(f"grader: {error}", file=sys.stderr)
        return 2
    if not args.keep and not args.workspace:
        shutil.rmtree(workspace, ignore_errors=True)
    print(f"{reward:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
