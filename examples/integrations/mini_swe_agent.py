"""mini-swe-agent (bash-only coding agent) on a task in a directory, through the agl sidecar; the
reward is whether the task's check command passes afterwards.

    python examples/integrations/mini_swe_agent.py --sidecar http://127.0.0.1:8080 --model my-model \\
        --repo ./my-repo --task "Fix the failing test in tests/test_x.py" --check "python -m pytest -q"
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import agl
import yaml
from agl_integrations.mini_swe_agent import swe_model
from minisweagent import config as swe_config
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments.local import LocalEnvironment


def run(sidecar: str, model: str, repo: str, task: str, check: str, step_limit: int = 30) -> dict:
    agent_config = yaml.safe_load((Path(swe_config.__file__).parent / "mini_textbased.yaml").read_text())[
        "agent"
    ]
    agent_config.update(step_limit=step_limit, cost_limit=0)  # an open model has no price
    with agl.rollout(task_id=task[:64]):
        agent = DefaultAgent(
            swe_model(model, sidecar, model_kwargs={"max_tokens": 1024}),
            LocalEnvironment(cwd=repo),
            **agent_config,
        )
        result = agent.run(task)
        passed = subprocess.run(check, shell=True, cwd=repo, capture_output=True, check=False).returncode == 0
        agl.emit_reward(1.0 if passed else 0.0)
    return {"exit_status": result.get("exit_status"), "passed": passed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sidecar", required=True, help="the sidecar's URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--model", required=True, help="the model name the engine serves")
    parser.add_argument("--repo", required=True, help="the directory the agent works in")
    parser.add_argument("--task", required=True, help="what the agent must do")
    parser.add_argument("--check", required=True, help="a shell command that exits 0 when the task is done")
    parser.add_argument("--step-limit", type=int, default=30)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.sidecar, args.model, args.repo, args.task, args.check, args.step_limit)))
    agl.flush()


if __name__ == "__main__":
    main()
