"""The demo's log, as a file gets it: no third-party progress bars (transformers drew "Loading
weights" at each of the five loads) and no line rich broke at 80 columns."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.slow
def test_the_demo_log_has_no_loading_bars_and_whole_lines(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch
) -> None:
    from transformers.utils import logging as hf_logging

    from examples.demo.run import run_demo

    monkeypatch.delenv("COLUMNS", raising=False)
    hf_logging.enable_progress_bar()  # as a user's process has it
    overrides = ["--loop.batch_rollouts=16", "--loop.val_sampled=1", "--viewer.enabled=false"]
    run_demo(tmp_path / "demo", seed=0, budget_s=3600, max_steps=1, n_tasks=16, n_val_tasks=2, val_every=1,
             overrides=overrides)  # fmt: skip
    printed = capfd.readouterr()
    log = printed.out + printed.err
    assert "Loading weights" not in log and "\r" not in log, log
    validation = [line for line in log.splitlines() if line.startswith("agl: validation at step")]
    assert len(validation) == 2 and all("failed); sampled mean@1" in line for line in validation), log
    assert hf_logging.is_progress_bar_enabled()  # the run gives the user's setting back
