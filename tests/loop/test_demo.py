"""`agl demo` end to end with a fixed seed: warm start, then RL through the pipeline; reward rises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_reward_rises(tmp_path: Path) -> None:
    from examples.demo.run import run_demo

    summary = run_demo(tmp_path / "demo", seed=0, budget_s=240, quiet=True)
    assert 0.3 < summary["reward_warm_start"] < 0.7  # the warm start is its own, measured phase
    assert summary["steps"] >= 20
    # A clear rise through the full pipeline (first RL steps vs last ones).
    assert summary["reward_rl_last"] >= summary["reward_rl_first"] + 0.1, summary
    out = tmp_path / "demo"
    assert (out / "reward.png").stat().st_size > 0
    assert any((out / "tensorboard").iterdir())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "reward/mean" in row]
    assert len(train) == summary["steps"] and all("actor/entropy" in row for row in train)
    # Held-out validation: a round before the first step, then every val_every steps, never trained.
    val_steps = [row["step"] for row in rows if "val/reward" in row]
    assert val_steps[0] == 0 and summary["val_rounds"] == len(val_steps) >= 2
