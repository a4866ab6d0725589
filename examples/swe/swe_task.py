"""A SWE-style task and the rollout's workspace, shared by the harness and the grader.

A task is one JSON line (SWE-bench's field names):

    {"id": "calc-mean", "repo": "repos/calc", "problem_statement": "mean() is wrong ...",
     "FAIL_TO_PASS": ["tests/test_calc.py::test_mean"], "PASS_TO_PASS": ["tests/test_calc.py::test_total"],
     "patch": "<the reference fix, a unified diff>"}

`repo` is a directory (relative paths are resolved against this example's directory); each rollout
works on its own copy, `workspace_root() / <run id>-<rollout id>` (AGL_RUN_ID: `agl eval`'s rollout
ids repeat from run to run, so two evaluations at once would share, and wipe, each other's copies),
made fresh by the harness (a retried attempt starts over) and removed by the grader after it ran the
tests.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SAFE_ID = re.compile(r"[A-Za-z0-9._-]{1,200}")
SUBMITTED = "Submitted"  # mini-swe-agent's exit status after the agent's submit command


class TaskError(ValueError):
    """A task or environment that cannot work; the message names the field and the fix."""


@dataclass(frozen=True)
class SweTask:
    id: str
    repo: Path
    problem_statement: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]

    @property
    def tests(self) -> list[str]:
        return self.fail_to_pass + self.pass_to_pass

    @property
    def test_files(self) -> list[str]:
        """The files the graded tests live in: restored from the task's repo before grading, so an
        agent that edits a test cannot make it pass."""
        return sorted({test.split("::", 1)[0] for test in self.tests})


def parse_task(raw: dict[str, Any]) -> SweTask:
    def text(name: str) -> str:
        value = raw.get(name)
        if not isinstance(value, str) or not value.strip():
            raise TaskError(f"task field {name!r}: expected a non-empty string, got {value!r}")
        return value

    def tests(name: str, required: bool) -> list[str]:
        value = raw.get(name, [])
        if not isinstance(value, list) or not all(isinstance(t, str) and t.strip() for t in value):
            raise TaskError(f"task field {name!r}: expected a list of pytest test ids, got {value!r}")
        if required and not value:
            raise TaskError(f"task field {name!r}: at least one test must fail before the fix")
        for test in value:
            path = test.split("::", 1)[0]
            if Path(path).is_absolute() or ".." in Path(path).parts:
                raise TaskError(f"task field {name!r}: {test!r} must name a test inside the repo")
        return list(value)

    task_id = text("id")
    repo = Path(text("repo"))
    repo = repo if repo.is_absolute() else HERE / repo
    if not repo.is_dir():
        raise TaskError(f"task {task_id}: repo {repo} is not a directory (fix: the task's repository path)")
    return SweTask(
        id=task_id,
        repo=repo,
        problem_statement=text("problem_statement"),
        fail_to_pass=tests("FAIL_TO_PASS", required=True),
        pass_to_pass=tests("PASS_TO_PASS", required=False),
    )


def workspace_root() -> Path:
    configured = os.environ.get("AGL_SWE_WORKDIR")
    return Path(configured) if configured else Path(tempfile.gettempdir()) / f"agl-swe-{os.getuid()}"


def workspace_for(rollout_id: str) -> Path:
    """The rollout's copy: keyed by the agl run (AGL_RUN_ID, when the runner sets it) and the rollout."""
    run_id = os.environ.get("AGL_RUN_ID", "")
    for what, value in (("rollout id", rollout_id), ("run id (AGL_RUN_ID)", run_id or "-")):
        if not SAFE_ID.fullmatch(value):
            raise TaskError(f"{what} {value!r} is not a safe directory name")
    return workspace_root() / (f"{run_id}-{rollout_id}" if run_id else rollout_id)


def fresh_copy(task: SweTask, workspace: Path) -> Path:
    """The task's repo copied to `workspace` (anything there before is removed)."""
    if workspace.exists():
        shutil.rmtree(workspace)
    workspace.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(task.repo, workspace, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    return workspace
