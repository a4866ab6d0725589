"""examples/swe/config.yaml end to end on the CPU: the tiny model behind the embedded engine (torch
backend, via overrides), mini-swe-agent as the harness through the real sidecar, the test-based
grader after each rollout; its reward reaches the store. The tiny model does not fix the bugs:
reward 0.0 is expected; what is checked is that the harness ran, its calls were recorded, the
grader's reward is in the store, and a step trained on them."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_swe_example_runs_end_to_end_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agl_trainer.config import load_config
    from agl_trainer.run.session import Session
    from agl_trainer.models.tiny import TinyModelSpec, build_bpe_model
    from agl_trainer.store import RolloutStore

    monkeypatch.chdir(ROOT)
    model = build_bpe_model(tmp_path / "tiny", TinyModelSpec(hidden=128, heads=2, kv_heads=2, max_positions=2048))
    python = sys.executable
    overrides = {
        "output_dir": str(tmp_path / "run"),
        "model.path": str(model),
        "model.name": "tiny",
        "harness.command": f"{python} examples/swe/harness.py --model tiny --step-limit 2 --max-tokens 16 "
        "--agent-config examples/swe/agent-compact.yaml",
        "harness.grader": f"{python} examples/swe/grader.py",
        "harness.timeout_s": 120,
        "harness.retries": 0,
        "backend.name": "torch",
        "backend.device": "cpu",
        "backend.lr": 1e-3,
        "backend.options": "{}",
        "engine.name": "embedded",
        "engine.replicas": 1,
        "engine.options": "{}",
        "loop.mode": "sync",
        "loop.batch_rollouts": 3,
        "loop.group_size": 1,
        "loop.concurrency": 3,
        "loop.max_steps": 1,
        "loop.completion_grace_s": 0.5,
    }
    args = [f"--{key}={value}" for key, value in overrides.items()]
    args.append(f"--harness.env.AGL_SWE_WORKDIR={tmp_path / 'workspaces'}")
    config = load_config(ROOT / "examples/swe/config.yaml", args)
    result = asyncio.run(Session(config, quiet=True).run())
    assert result.summary.steps == 1

    tasks = {json.loads(line)["id"] for line in (ROOT / "examples/swe/tasks.jsonl").read_text().splitlines()}
    with RolloutStore(Path(config.output_dir) / "rollouts.db") as store:
        rollouts = store.rollouts()
        assert {r.task_id for r in rollouts} == tasks
        for rollout in rollouts:
            assert rollout.calls >= 1, rollout  # mini-swe-agent's calls went through the sidecar
            assert rollout.harness_exit_code == 0 and rollout.mode == "train", rollout
        rewards = store.final_rewards(r.key for r in rollouts)
        assert set(rewards) == {r.key for r in rollouts}  # the grader's reward of each rollout
        assert set(rewards.values()) == {0.0}
        assert all(r.trained_step == 1 for r in rollouts)
    assert not any((tmp_path / "workspaces").iterdir())  # the grader cleaned up after itself
