"""A running `agl train` serves the viewer over its own store, its address printed at start."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.loop.test_loop import make_config, model_dir, run_session  # noqa: F401 (model_dir: a fixture)
from tests.viewer.conftest import get


class _Url:
    def __init__(self, url: str) -> None:
        self.url = url


@pytest.mark.slow
def test_a_training_run_serves_the_viewer_over_its_store(tmp_path: Path, model_dir: Path, capsys) -> None:  # noqa: F811
    config = make_config(
        tmp_path, model_dir, [{"id": "t"}], "tests.loop.harnesses:calls",
        mode="sync", batch_rollouts=2, group_size=2, max_steps=2,
    )  # fmt: skip
    config.viewer.listen = "127.0.0.1:0"
    seen: list[dict] = []

    def on_step(step: int, metrics: dict[str, float]) -> None:
        [url] = re.findall(r"trace viewer at (http://\S+)", capsys.readouterr().err) or [seen[0]["url"]]
        server = _Url(url)
        status, rollouts = get(server, "/api/rollouts?step=" + str(step))
        _, first = get(server, "/api/rollout?id=" + rollouts["rows"][0]["rollout_id"])
        seen.append({"url": url, "status": status, "rollouts": rollouts, "first": first})

    result = run_session(config, on_step)
    assert result.summary.steps == 2
    assert [entry["status"] for entry in seen] == [200, 200]
    for entry in seen:
        assert entry["rollouts"]["total"] == 2  # the step's rollouts, read while the run writes
        assert entry["first"]["calls"] and entry["first"]["samples"] and entry["first"]["decoded"] is True
