"""The SWE harness (harness.command): mini-swe-agent fixes the task's repo through the agl sidecar.

    python examples/swe/harness.py --model qwen3-8b [--agent-config FILE] [--step-limit 30] [--client openai]

Run once per rollout by agl's runner, which sets AGL_TASK (the task JSON, see swe_task.py),
AGL_ROLLOUT_ID and OPENAI_BASE_URL (the sidecar's URL for this rollout, so every model call is
recorded with its token IDs). The agent works on a fresh copy of the task's repo in the rollout's
workspace; the reward comes afterwards from grader.py (harness.grader), which runs the tests there.

The agent's settings are mini-swe-agent's own config files (sections `agent`, `model`,
`environment`); the default is its `mini_textbased.yaml` (bash blocks parsed from the text, so any
model works without a tool-call parser). `agent-compact.yaml` has short prompts for tiny models.
`--network none` runs each bash command without network (sandbox.py: a network namespace); the
agent's commands find this Python (and its pytest) first on PATH. Exit status: 0 when the agent
ended by itself (submitted, step limit, repeated format errors, or its conversation outgrew the
model's context: `ContextWindowExceeded`, graded as the workspace stands), non-zero when a model call
or the environment failed (the runner retries those).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `examples` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import agl
import yaml
from agl_integrations.mini_swe_agent import CLIENTS

from examples.swe.sandbox import IsolationError, isolated_environment, require_isolation
from examples.swe.swe_task import TaskError, fresh_copy, parse_task, workspace_for


def default_agent_config() -> Path:
    from minisweagent import config as swe_config

    return Path(swe_config.__file__).parent / "mini_textbased.yaml"


def load_agent_config(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict) or not isinstance(data.get("agent"), dict):
        raise TaskError(f"agent config {path}: expected a mini-swe-agent config with an `agent` section")
    return data


def make_environment(settings: dict[str, Any], workspace: Path, network: str) -> Any:
    """mini-swe-agent's local environment in `workspace`, this Python first on PATH; without
    network (sandbox.py) unless `network` is "host"."""
    from minisweagent.environments.local import LocalEnvironment

    config = {**(settings.get("environment") or {}), "cwd": str(workspace)}
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    config["env"] = {**config.get("env", {}), "PATH": path}
    return LocalEnvironment(**config) if network == "host" else isolated_environment(**config)


def run(task_raw: dict[str, Any], rollout_id: str, model: str, agent_config: Path, step_limit: int,
        max_tokens: int, temperature: float | None, network: str = "host", client: str = "litellm") -> dict[str, Any]:  # fmt: skip
    from agl_integrations.mini_swe_agent import context_overflow, swe_model
    from minisweagent.agents.default import DefaultAgent

    task = parse_task(task_raw)
    workspace = fresh_copy(task, workspace_for(rollout_id))
    settings = load_agent_config(agent_config)
    agent_settings = {**settings["agent"], "step_limit": step_limit, "cost_limit": 0}  # open models have no price
    model_settings = dict(settings.get("model") or {})
    model_kwargs = {**model_settings.pop("model_kwargs", {}), "max_tokens": max_tokens}
    if temperature is not None:
        model_kwargs["temperature"] = temperature
    with agl.rollout(task_id=task.id):  # the rollout's id comes from the runner (AGL_ROLLOUT_ID)
        agent = DefaultAgent(
            swe_model(model, client=client, model_kwargs=model_kwargs, **model_settings),
            make_environment(settings, workspace, network),
            **agent_settings,
        )
        try:
            result = agent.run(task.problem_statement)
        except Exception as error:  # mini-swe-agent re-raises a model call's error after saving the trajectory
            if not context_overflow(error):
                raise
            # The agent's own ending, like its step limit: the rollout is graded and trained on as a
            # failure to finish in its context, not dropped as a harness error (which biases its group).
            result = {"exit_status": "ContextWindowExceeded"}
    return {"task": task.id, "exit_status": result.get("exit_status"), "steps": agent.n_calls, "workspace": str(workspace)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.environ.get("AGL_MODEL", "tiny"), help="the served model name")
    parser.add_argument("--agent-config", type=Path, default=None, help="a mini-swe-agent config YAML")
    parser.add_argument("--step-limit", type=int, default=30, help="most model calls per rollout")
    parser.add_argument("--max-tokens", type=int, default=2048, help="most tokens per model reply")
    parser.add_argument("--temperature", type=float, default=None, help="default: the engine's sampling config")
    parser.add_argument("--network", choices=("host", "none"), default="host",
                        help="none: each bash command in a network namespace without network (sandbox.py)")
    parser.add_argument("--client", choices=CLIENTS, default="litellm",
                        help="how the agent calls the sidecar: mini-swe-agent's litellm model, or openai (the same "
                        "text-based model over the OpenAI SDK: spares each rollout's process litellm's ~4 s import)")
    args = parser.parse_args(argv)
    task_json, rollout_id = os.environ.get("AGL_TASK"), os.environ.get("AGL_ROLLOUT_ID")
    if not task_json or not rollout_id:
        print("harness: AGL_TASK and AGL_ROLLOUT_ID must be set (agl's runner sets them)", file=sys.stderr)
        return 2
    try:
        if args.network == "none":
            require_isolation()
        outcome = run(
            json.loads(task_json), rollout_id, args.model, args.agent_config or default_agent_config(),
            args.step_limit, args.max_tokens, args.temperature, args.network, args.client,
        )  # fmt: skip
    except (TaskError, IsolationError, json.JSONDecodeError) as error:
        print(f"harness: {error}", file=sys.stderr)
        return 2
    print(json.dumps(outcome))
    agl.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
