"""The SWE harness as the runner starts it: mini-swe-agent in the rollout's workspace, every model
call through the real sidecar (recorded as call spans of the rollout), then the grader's reward.
The engine is the scripted stand-in of real vLLM (testing/agl_testing/fake_vllm.py): its replies fix the
bug with sed and submit, so the grader must say 1.0; a reply that does nothing gets 0.0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from agl import semconv
from agl_sidecar.config import SidecarConfig
from agl_sidecar.server import BackgroundSidecar

from agl_testing.fake_vllm import FakeVLLM
from tests.support.otlp_sink import OTLPSink

ROOT = Path(__file__).resolve().parents[2]
CALC = next(json.loads(line) for line in (ROOT / "examples/swe/tasks.jsonl").read_text().splitlines() if "calc-mean" in line)
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def run_rollout(sink: OTLPSink, tmp_path: Path, rollout_id: str, first_command: str) -> tuple[str, list]:
    def act(body: dict, choice: int) -> str:
        done = any(m["role"] == "assistant" for m in body["messages"])
        return f"THOUGHT: go\n\n```mswea_bash_command\n{SUBMIT if done else first_command}\n```"

    config = SidecarConfig(
        upstream=[""], listen="127.0.0.1:0", otlp_endpoint=sink.endpoint, spool_dir=str(tmp_path / "spool"),
        export_interval_s=0.05,
    )  # fmt: skip
    env = {
        **os.environ, "AGL_TASK": json.dumps(CALC), "AGL_ROLLOUT_ID": rollout_id,
        "AGL_SWE_WORKDIR": str(tmp_path / "ws"), "OPENAI_API_KEY": "x",
    }  # fmt: skip
    with FakeVLLM(reply=act) as fake:
        config.upstream = [fake.base_url]
        with BackgroundSidecar(config) as sidecar:
            env["OPENAI_BASE_URL"] = f"{sidecar.url}/rollouts/{rollout_id}/v1"
            harness = subprocess.run(
                [sys.executable, str(ROOT / "examples/swe/harness.py"), "--model", "tiny", "--step-limit", "4",
                 "--agent-config", str(ROOT / "examples/swe/agent-compact.yaml")],
                env=env, capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert harness.returncode == 0, harness.stderr[-3000:]
            spans = sink.wait_for(
                lambda s: sum(x.name == "chat tiny" and x.attributes.get(semconv.ROLLOUT_ID) == rollout_id for x in s) >= 2
            )
    grader = subprocess.run(
        [sys.executable, str(ROOT / "examples/swe/grader.py")], env=env, capture_output=True, text=True, check=False
    )
    assert grader.returncode == 0, grader.stderr
    calls = [s for s in spans if s.name == "chat tiny" and s.attributes.get(semconv.ROLLOUT_ID) == rollout_id]
    assert json.loads(harness.stdout.strip().splitlines()[-1])["exit_status"] == "Submitted"
    return grader.stdout.strip().splitlines()[-1], calls


def test_agent_fixes_the_repo_and_the_grader_says_1(otlp_sink: OTLPSink, tmp_path: Path) -> None:
    reward, calls = run_rollout(otlp_sink, tmp_path, "fix-1", "sed -i 's|(len(values) - 1)|len(values)|' calc.py")
    assert reward == "1.0"
    assert len(calls) == 2 and all(c.attributes[semconv.CALL_API] == semconv.API_CHAT_COMPLETIONS for c in calls)


def test_agent_that_does_nothing_gets_0(otlp_sink: OTLPSink, tmp_path: Path) -> None:
    reward, calls = run_rollout(otlp_sink, tmp_path, "idle-1", "ls")
    assert reward == "0.0" and len(calls) == 2


def test_harness_without_the_runner_environment_is_refused() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("AGL_TASK", "AGL_ROLLOUT_ID")}
    result = subprocess.run([sys.executable, str(ROOT / "examples/swe/harness.py")], env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 2 and "AGL_TASK and AGL_ROLLOUT_ID must be set" in result.stderr


@pytest.mark.parametrize("rollout_id", ["../escape", "a/b", ""])
def test_unsafe_rollout_ids_do_not_become_paths(rollout_id: str) -> None:
    from examples.swe.swe_task import TaskError, workspace_for

    with pytest.raises(TaskError):
        workspace_for(rollout_id)
