"""examples/swe_lite/config.yaml through the whole pipeline on two generated tasks: `agl train`'s
session (collocated-async, the runner, unmodified mini-swe-agent through examples/swe/harness.py with
bash in a network namespace, the grader refusing test edits, the receiver, the store, assembly, the
torch backend) with a scripted policy in place of the model: a deterministic fake vLLM behind a real
sidecar answers each call with the demonstration's next action. On one task it searches, reads,
fixes, tests and submits (the grader says 1.0); on the other it reads, tests and submits without a
fix (0.0). One step trains on both rollouts' recorded tokens."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_swe_lite_config_trains_a_step_on_a_solved_and_an_unsolved_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agl_testing.fake_vllm import FakeVLLM
    from agl_trainer.config import load_config
    from agl_trainer.models.tiny import build_bpe_model
    from agl_trainer.run.session import Session
    from agl_trainer.run.sidecar_client import SidecarProcess
    from agl_trainer.store import RolloutStore

    from examples.swe_lite.demonstrations import replies
    from examples.swe_lite.generate import generate, write_tasks
    from tests.support.ports import free_port

    monkeypatch.chdir(ROOT)
    solved, unsolved = generate("train", 2, seed=11)
    tasks_file = write_tasks([solved, unsolved], tmp_path / "tasks")
    policy = {solved["problem_statement"]: replies(solved, search=True), unsolved["problem_statement"]: replies(unsolved, fix=False)}

    def act(body: dict, choice: int) -> str:
        statement = next(m["content"].strip() for m in body["messages"] if m["role"] == "user")
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        return policy[statement][turn]

    model = build_bpe_model(tmp_path / "tiny")  # trains on the fake's byte-level token ids (< its vocabulary)
    receiver_port = free_port()
    with FakeVLLM(reply=act) as engine:
        sidecar = SidecarProcess([engine.base_url], f"http://127.0.0.1:{receiver_port}", admin_token="t",
                                 log_path=tmp_path / "sidecar.log")  # fmt: skip
        sidecar.start()
        monkeypatch.setenv("SWE_LITE_SIDECAR_TOKEN", "t")
        try:
            python = sys.executable
            overrides = {
                "tasks": str(tasks_file), "output_dir": str(tmp_path / "run"), "model.path": str(model),
                "harness.command": f"{python} examples/swe/harness.py --model tiny --step-limit 6 --max-tokens 512 "
                "--agent-config examples/swe_lite/agent.yaml --network none",
                "harness.grader": f"{python} examples/swe/grader.py --refuse-test-edits",
                "harness.timeout_s": 120, "engine.max_batch": 4, "receiver.listen": f"127.0.0.1:{receiver_port}",
                "loop.batch_rollouts": 2, "loop.group_size": 1, "loop.concurrency": 2, "loop.max_steps": 1,
                "loop.max_train_s": 0, "loop.completion_grace_s": 0.5,
                "val_tasks": "null", "loop.val_every": 0,  # no held-out rounds (and no prepared set needed)
            }  # fmt: skip
            args = [f"--{key}={value}" for key, value in overrides.items()]
            args += [f"--harness.env.AGL_SWE_WORKDIR={tmp_path / 'workspaces'}", "--sidecar.attach",
                     json.dumps([{"url": sidecar.url, "admin_token_env": "SWE_LITE_SIDECAR_TOKEN",
                                 "upstreams": [engine.base_url]}])]  # fmt: skip
            config = load_config(ROOT / "examples/swe_lite/config.yaml", args)
            assert config.loop.mode == "collocated-async" and config.backend.name == "torch"
            assert config.backend.algorithm.kl_coef > 0  # the config's KL term: a reference copy of model.path loads
            result = asyncio.run(Session(config, quiet=True).run())
        finally:
            sidecar.stop()
    assert result.summary.steps == 1
    (step,) = [json.loads(line) for line in (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert step["actor/ref_kl"] == pytest.approx(0.0, abs=1e-6)  # the first step's policy is still the reference

    with RolloutStore(Path(config.output_dir) / "rollouts.db") as store:
        rollouts = {r.task_id: r for r in store.rollouts()}
        assert set(rollouts) == {solved["id"], unsolved["id"]}
        rewards = store.final_rewards(r.key for r in rollouts.values())
        assert {task: rewards[r.key] for task, r in rollouts.items()} == {solved["id"]: 1.0, unsolved["id"]: 0.0}
        assert rollouts[solved["id"]].calls == 5 and rollouts[unsolved["id"]].calls == 3  # each reply a recorded call
        assert all(r.harness_exit_code == 0 and r.trained_step == 1 for r in rollouts.values())
    # stages.py reads the same store back: the solved rollout reached every stage, the other ran the tests and read the file
    from agl_testing.fake_vllm import decode

    from examples.swe_lite.stages import read_run

    counts = read_run(Path(config.output_dir), {t["id"]: t for t in (solved, unsolved)}, decode)
    assert counts.rollouts == 2
    assert counts.reached == {"tests": 2, "read_right": 2, "read_package": 2, "read_module": 2, "edited_right": 1, "fix": 1,
                              "passed": 1, "submitted": 2, "submitted_passed": 1, "submitted_unpassed": 1}  # fmt: skip
    left = {path.name for path in (tmp_path / "workspaces").iterdir()}
    assert not left & {r.rollout_id for r in rollouts.values()}  # the grader removed the graded copies
