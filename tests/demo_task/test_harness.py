"""The demo harness against the embedded engine directly (no sidecar): as a script and in-process."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from agl import semconv
from transformers import AutoModelForCausalLM, AutoTokenizer

from examples.demo import harness
from examples.demo.episodes import DemoTokens, run_episodes
from examples.demo.task import make_tasks

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "demo" / "harness.py"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGL_", "OPENAI_", "OTEL_"))}
    return {**env, **extra}


def test_script_emits_its_reward_to_the_otlp_endpoint(demo_engine, otlp_sink) -> None:
    task = make_tasks(1, seed=42)[0]
    result = subprocess.run(
        [sys.executable, str(SCRIPT)],
        env=_env(
            OPENAI_BASE_URL=demo_engine.urls[0] + "/v1",
            AGL_TASK=json.dumps(task),
            AGL_ROLLOUT_ID="rollout-7",
            AGL_TASK_ID=task["task_id"],
            AGL_OTLP_ENDPOINT=otlp_sink.endpoint,
        ),
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert result.returncode == 0, result.stderr
    printed = float(result.stdout.split()[-1])
    spans = otlp_sink.wait_for(lambda s: any(x.name == semconv.SPAN_REWARD for x in s), timeout=30)
    reward = next(s for s in spans if s.name == semconv.SPAN_REWARD)
    assert reward.attributes[semconv.ROLLOUT_ID] == "rollout-7"
    assert reward.attributes[semconv.TASK_ID] == task["task_id"]
    assert abs(reward.attributes[semconv.REWARD_VALUE] - printed) < 1e-3
    assert 0.0 <= printed <= 1.0


def test_script_without_its_environment_says_what_to_set() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], env=_env(), capture_output=True, check=False, text=True, timeout=60
    )
    assert result.returncode == 2 and "AGL_TASK" in result.stderr and "OPENAI_BASE_URL" in result.stderr
    result = subprocess.run(
        [sys.executable, str(SCRIPT)],
        env=_env(AGL_TASK='{"key": 3}', OPENAI_BASE_URL="http://127.0.0.1:9/v1"),
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "'key'" in result.stderr and "Traceback" not in result.stderr


def test_greedy_rewards_through_the_engine_equal_in_process_rewards(demo_engine, prepared) -> None:
    """Engine + harness and the in-process sampler play the same greedy episodes: same rewards."""
    tasks = make_tasks(12, seed=9)
    url = demo_engine.urls[0] + "/v1"
    via_engine = [harness.run_episode(t, url, temperature=0.0) for t in tasks]
    model = AutoModelForCausalLM.from_pretrained(prepared.path, dtype=torch.float32)
    tokens = DemoTokens(AutoTokenizer.from_pretrained(prepared.path))
    in_process = [e.reward for e in run_episodes(model, tokens, tasks, temperature=0.0)]
    assert via_engine == in_process

    async def concurrently() -> list[float]:
        return list(
            await asyncio.gather(*(harness.run_episode_async(t, url, temperature=0.0) for t in tasks))
        )

    assert asyncio.run(concurrently()) == via_engine
