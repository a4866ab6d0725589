"""Loop checkpoints: the loop's state survives a save and load, older checkpoints still load."""

from __future__ import annotations

import json
from pathlib import Path

from agl_trainer.loop.checkpoint import Checkpoints, LoopState


class _Backend:
    def save_checkpoint(self, directory: Path) -> None:
        directory.mkdir(parents=True)
        (directory / "weights").write_text("w")


def test_state_round_trips_with_trained_keys_as_pairs(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path / "checkpoints")
    state = LoopState(step=3, policy_version=3, next_group_index=7, trained_since_previous=[("r1", 0), ("r2", 1)])
    checkpoints.save(state, _Backend())
    latest = checkpoints.latest()
    assert latest is not None and (latest / "backend" / "weights").read_text() == "w"
    loaded = checkpoints.load(latest)
    assert loaded == state
    assert loaded.trained_since_previous == [("r1", 0), ("r2", 1)]


def test_a_checkpoint_written_with_a_removed_field_still_loads(tmp_path: Path) -> None:
    directory = tmp_path / "step_000002"
    directory.mkdir()
    old = {"step": 2, "policy_version": 2, "next_group_index": 4, "trained_since_previous": [["r", 0]], "run_id": "x"}
    (directory / "loop.json").write_text(json.dumps({**old, "extra": {}}))
    loaded = Checkpoints(tmp_path).load(directory)
    assert (loaded.step, loaded.next_group_index, loaded.run_id) == (2, 4, "x")
    assert loaded.trained_since_previous == [("r", 0)]
