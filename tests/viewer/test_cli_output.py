"""The CLI's output to a pipe or a file keeps every line whole: rich took 80 columns off a terminal
and broke longer lines mid-sentence (agl_trainer/console.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from agl_testing.rollouts import write_rollouts
from agl_trainer.loop.progress import LoopProgress
from agl_trainer.store import RolloutStore

LONG_ID = "a-rollout-id-far-longer-than-eighty-columns-" + "x" * 60 + "-7"


def test_traces_ls_through_a_pipe_keeps_a_long_id_and_the_summary_on_one_line(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with RolloutStore(path, grace_s=0.0) as store:
        write_rollouts(store, [LONG_ID])
        store.refresh_completion()
    env = {key: value for key, value in os.environ.items() if key != "COLUMNS"}
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from agl_trainer.cli import main; sys.exit(main())",
         "traces", "ls", "--store", str(path), "--grace-s", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(LONG_ID in line for line in lines), done.stdout  # the id whole, on its row
    summary = [line for line in lines if "complete (" in line]
    assert len(summary) == 1 and summary[0].rstrip().endswith("last step -"), done.stdout
    assert len(summary[0]) > 80  # the line that rich broke before


def test_a_loop_message_to_a_file_is_one_line(capfd: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    progress = LoopProgress(max_steps=2, batch_rollouts=4, enabled=True)
    message = "agl: validation at step 0: reward 1.000, pass rate 1.000 over 32 rollouts (0 failed); sampled mean@4 0.541"
    progress.log(message)
    progress.close()
    assert message in capfd.readouterr().err.splitlines()
