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

# Runs are bounded by steps, not seconds: what a test sees must not depend on the machine's load.
TRAIN_STEPS = 24
PARTIAL_STEPS = 4
TIMEOUT_S = 1800


@pytest.fixture(scope="module")
def demo_run(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_on_vllm(vllm_python, tmp_path_factory.mktemp("demo-vllm"), TRAIN_STEPS)


@pytest.fixture(scope="module")
def partial_run(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """#29's scheduling: no step waits for a running group (stale tokens masked), and the rollouts go on
    generating on vLLM while the trainer trains; vLLM's keep pause is the only pause, for the weight load."""
    loop = {"switch": "keep", "stale_policy": "mask", "generate_during_training": True, "staleness": 2}
    return train_on_vllm(vllm_python, tmp_path_factory.mktemp("partial-vllm"), PARTIAL_STEPS, loop)


def train_on_vllm(vllm_python: str, work: Path, max_steps: int, loop: dict | None = None) -> Path:
    from examples.demo.prepare import prepare_demo_model
    from examples.demo.task import write_tasks

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
    config["loop"].update(max_steps=max_steps, max_train_s=TIMEOUT_S, checkpoint_every=1 if loop else 1000, val_every=0, **(loop or {}))
    config.update(val_tasks=None, viewer={"enabled": False})  # training only: no validation rounds
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [str(Path(sys.executable).parent / "agl"), "train", str(work / "config.yaml"), "--quiet"],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S + 600,
    )  # fmt: skip
    assert result.returncode == 0, f"agl train failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    (work / "agl-train.log").write_text(result.stdout + result.stderr)
    return work / "train"


def steps(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]


def test_collocated_async_demo_on_vllm_raises_the_reward(demo_run: Path) -> None:
    metrics = steps(demo_run)
    assert len(metrics) == TRAIN_STEPS
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


def test_partial_scheduling_on_vllm_trains_each_rollout_once_within_the_token_bound(partial_run: Path) -> None:
    import numpy as np

    from agl_trainer.assembly.versions import token_versions
    from agl_trainer.store import RolloutStore

    metrics = steps(partial_run)
    assert len(metrics) == PARTIAL_STEPS
    assert all(m["time/generating_during_training_s"] > 0 for m in metrics)  # vLLM generated while training
    assert all(m["staleness/max"] <= 2 for m in metrics if "staleness/max" in m)  # loop.staleness per token
    with RolloutStore(partial_run / "rollouts.db") as store:
        trained = [i for i in store.find("") if i.trained_step is not None]
        # no rollout trained twice or lost between steps: each step's count is the store's
        for step, row in enumerate(metrics, start=1):
            assert row["rollouts/trained"] == sum(i.trained_step == step for i in trained)
        for info in trained:
            for call in store.load(info.key).calls:
                if call.completion_ids is None or call.completion_ids.size == 0:
                    continue
                versions = token_versions(call)
                # sampled by the version the call entered under or a later one, never by weights newer
                # than those that trained it (step s trains at version s - 1)
                assert versions[0] >= call.policy_version and np.all(np.diff(versions) >= 0)
                assert versions[-1] <= info.trained_step - 1
