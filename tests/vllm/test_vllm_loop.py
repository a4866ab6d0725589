"""`agl train` on real vLLM (CPU build): the demo task in collocated-async mode, reward rises.

The full pipeline as a user runs it: `agl train CONFIG` (a subprocess) starts vLLM through
VLLMEngine, the sidecar, the receiver and the runners; the harness calls the model through the
sidecar; every step pauses the sidecar, trains, syncs the weights into vLLM in place and resumes.
This module runs before the others that share one server (names sort), so only one vLLM runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.vllm.conftest import REPO

pytestmark = pytest.mark.vllm

TRAIN_SECONDS = 90


@pytest.fixture(scope="module")
def demo_run(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.demo.prepare import prepare_demo_model
    from examples.demo.task import write_tasks

    work = tmp_path_factory.mktemp("demo-vllm")
    prepared = prepare_demo_model(work, seed=0, progress=False)
    tasks = write_tasks(work / "tasks.jsonl", 256, 0)
    config = yaml.safe_load((REPO / "examples" / "demo" / "config.yaml").read_text())
    config.update(tasks=str(tasks), output_dir=str(work / "train"))
    config["model"]["path"] = str(prepared.path)
    config["engine"] = {
        "name": "vllm",
        "options": {
            "python": vllm_python,
            "served_model_name": config["model"]["name"],
            "log_dir": str(work / "vllm-logs"),
        },
    }
    config["loop"].update(max_train_s=TRAIN_SECONDS, checkpoint_every=1000, val_every=0)
    config.update(val_tasks=None, viewer={"enabled": False})  # training only: no validation rounds
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [str(Path(sys.executable).parent / "agl"), "train", str(work / "config.yaml"), "--quiet"],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=TRAIN_SECONDS + 600,
    )  # fmt: skip
    assert result.returncode == 0, f"agl train failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    (work / "agl-train.log").write_text(result.stdout + result.stderr)
    return work / "train"


def steps(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]


def test_collocated_async_demo_on_vllm_raises_the_reward(demo_run: Path) -> None:
    metrics = steps(demo_run)
    assert len(metrics) >= 10, f"only {len(metrics)} steps in {TRAIN_SECONDS} s"
    rewards = [m["reward/mean"] for m in metrics]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.05, f"reward did not rise: first steps {rewards[:5]}, last steps {rewards[-5:]}"
    assert [m["policy_version"] for m in metrics] == list(range(1, len(metrics) + 1))


def test_every_step_synced_weights_into_vllm_in_place(demo_run: Path) -> None:
    metrics = steps(demo_run)
    assert all(m["time/syncing_s"] > 0 for m in metrics)
    launches = (demo_run.parent / "vllm-logs" / "vllm-0.log").read_text().count("=== agl: ")
    assert launches == 1  # one server start for the whole run: every sync was in place
    assert sum(m["rollouts/failed"] for m in metrics) == 0
    log = (demo_run.parent / "agl-train.log").read_text()
    assert "Traceback" not in log
