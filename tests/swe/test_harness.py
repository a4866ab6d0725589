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


# vLLM's answer to a prompt as long as the model's context (its 400 body, as the CPU build sends it)
CONTEXT_FULL = {"error": {"message": "This model's maximum context length is 2048 tokens. However, your prompt contains "
                          "2054 input tokens, which leaves no room for output tokens. Please reduce the length of the "
                          "input prompt.", "type": "BadRequestError", "param": "input_tokens", "code": 400}}  # fmt: skip


def run_rollout(sink: OTLPSink, tmp_path: Path, rollout_id: str, first_command: str, *, client: str = "litellm",
                second: dict | None = None) -> tuple[str, list, dict]:  # fmt: skip
    """One rollout: `first_command`, then submit; `second`: the engine's 400 body for the second call instead."""

    def act(body: dict, choice: int) -> str:
        done = any(m["role"] == "assistant" for m in body["messages"])
        if not done and second is not None:
            fake.fail_next(400, second)
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
                 "--agent-config", str(ROOT / "examples/swe/agent-compact.yaml"), "--client", client],
                env=env, capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert harness.returncode == 0, harness.stderr[-3000:]
            spans = sink.wait_for(
                lambda s: sum(x.name == "chat tiny" and x.attributes.get(semconv.ROLLOUT_ID) == rollout_id for x in s)
                >= (1 if second else 2)
            )
    grader = subprocess.run(
        [sys.executable, str(ROOT / "examples/swe/grader.py")], env=env, capture_output=True, text=True, check=False
    )
    assert grader.returncode == 0, grader.stderr
    calls = [s for s in spans if s.name == "chat tiny" and s.attributes.get(semconv.ROLLOUT_ID) == rollout_id]
    return grader.stdout.strip().splitlines()[-1], calls, json.loads(harness.stdout.strip().splitlines()[-1])


FIX = "sed -i 's|(len(values) - 1)|len(values)|' calc.py"


def test_agent_fixes_the_repo_and_the_grader_says_1(otlp_sink: OTLPSink, tmp_path: Path) -> None:
    reward, calls, outcome = run_rollout(otlp_sink, tmp_path, "fix-1", FIX)
    assert reward == "1.0" and outcome["exit_status"] == "Submitted"
    assert len(calls) == 2 and all(c.attributes[semconv.CALL_API] == semconv.API_CHAT_COMPLETIONS for c in calls)


def test_agent_that_does_nothing_gets_0(otlp_sink: OTLPSink, tmp_path: Path) -> None:
    reward, calls, outcome = run_rollout(otlp_sink, tmp_path, "idle-1", "ls")
    assert reward == "0.0" and len(calls) == 2 and outcome["exit_status"] == "Submitted"


@pytest.mark.parametrize("client", ["litellm", "openai"])
def test_a_conversation_that_outgrows_the_context_ends_the_agent_and_is_graded(otlp_sink: OTLPSink, tmp_path: Path,
                                                                               client: str) -> None:  # fmt: skip
    """vLLM's 400 for a prompt as long as the context: before, the harness exited 1 with a traceback
    and the runner dropped the rollout (a harness error); now the agent ended there, exit 0, and the
    grader scores what it did (here the fix was in)."""
    reward, calls, outcome = run_rollout(otlp_sink, tmp_path, f"full-{client}", FIX, client=client, second=CONTEXT_FULL)
    assert outcome["exit_status"] == "ContextWindowExceeded" and outcome["steps"] == 2
    assert reward == "1.0"


def test_another_bad_request_is_still_a_harness_error(otlp_sink: OTLPSink, tmp_path: Path) -> None:
    """The OpenAI client gives up on a 400 (mini-swe-agent's litellm model retries it), and one that is
    not about the context stays the harness's error (exit 1), for the runner to retry or drop."""
    missing = {"error": {"message": "1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required'}",
                         "type": "Bad Request", "param": "body.messages", "code": 400}}  # fmt: skip
    with pytest.raises(AssertionError, match="BadRequestError"):  # run_rollout's returncode check, with the stderr
        run_rollout(otlp_sink, tmp_path, "bad-1", FIX, client="openai", second=missing)


def test_harness_without_the_runner_environment_is_refused() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("AGL_TASK", "AGL_ROLLOUT_ID")}
    result = subprocess.run([sys.executable, str(ROOT / "examples/swe/harness.py")], env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 2 and "AGL_TASK and AGL_ROLLOUT_ID must be set" in result.stderr


@pytest.mark.parametrize("rollout_id", ["../escape", "a/b", ""])
def test_unsafe_rollout_ids_do_not_become_paths(rollout_id: str) -> None:
    from examples.swe.swe_task import TaskError, workspace_for

    with pytest.raises(TaskError):
        workspace_for(rollout_id)


def test_two_runs_with_the_same_rollout_id_work_in_copies_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """agl eval's rollout ids repeat from run to run: two evaluations at once on one machine wiped each
    other's copies (their harnesses ran out of steps) until the workspace was keyed by AGL_RUN_ID too."""
    from examples.swe.swe_task import TaskError, workspace_for, workspace_root

    monkeypatch.setenv("AGL_RUN_ID", "eval-0a1b2c")
    first = workspace_for("eval-00003-0")
    monkeypatch.setenv("AGL_RUN_ID", "eval-3d4e5f")
    second = workspace_for("eval-00003-0")
    assert first != second and first.parent == second.parent == workspace_root()
    assert second.name == "eval-3d4e5f-eval-00003-0"
    monkeypatch.delenv("AGL_RUN_ID")  # by hand, without agl's runner
    assert workspace_for("eval-00003-0") == workspace_root() / "eval-00003-0"
    monkeypatch.setenv("AGL_RUN_ID", "../elsewhere")
    with pytest.raises(TaskError, match="run id"):
        workspace_for("eval-00003-0")
