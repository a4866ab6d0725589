"""The hops harness: the agent program of task.py (a main agent, a sub-agent per hop, retries,
compactions) over the `openai` SDK. Each agent thread sends its own `traceparent` (one trace per
rollout, one span id per thread), so the sidecar records which thread made each call.

    run_rollout(task, base_url)              # -> reward in [0, 1]; what `harness.function` calls
    python examples/hops/harness.py          # as a script: AGL_TASK and OPENAI_BASE_URL, as the demo's

`base_url` is the OpenAI base URL with `/v1` (the sidecar's `/rollouts/{id}/v1`). The temperature
is AGL_TEMPERATURE or the task's `temperature` (default 1.0); the sidecar's per-mode sampling
(`sampling.train`, `sampling.val`) overrides it.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from typing import Any

if __package__ in (None, ""):  # run as a script: make `examples` importable from the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.demo.harness import _sync_client
from examples.hops.task import Outcome, Reply, Request, agent, check_task, run

DEFAULT_MODEL = "tiny"


def _trace_id() -> str:
    """The rollout's trace (agl.rollout's span, when the runner made one), else a new one."""
    import agl

    current = agl.current_rollout()
    if current is not None:
        parent = current.headers().get("traceparent", "")
        if len(parent.split("-")) == 4:
            return parent.split("-")[1]
    return secrets.token_hex(16)


def play_rollout(
    task: dict[str, Any], base_url: str, *, model: str | None = None, temperature: float | None = None
) -> tuple[Outcome, list[tuple[Request, Reply, str]]]:
    """Run one rollout; returns its outcome and each call (request, reply, the thread's span id)."""
    check_task(task)
    model = model or os.environ.get("AGL_MODEL") or DEFAULT_MODEL
    if temperature is None:
        temperature = float(os.environ.get("AGL_TEMPERATURE") or task.get("temperature", 1.0))
    client = _sync_client(base_url)
    trace, spans = _trace_id(), {}
    made: list[tuple[Request, Reply, str]] = []

    def answer(request: Request) -> Reply:
        span = spans.setdefault(request.thread, secrets.token_hex(8))
        response = client.chat.completions.create(
            model=model,
            messages=request.messages,
            max_tokens=request.max_tokens,
            temperature=temperature,
            extra_headers={"traceparent": f"00-{trace}-{span}-01"},
        )
        choice = response.choices[0]
        reply = Reply(choice.message.content or "", choice.finish_reason or "length")
        made.append((request, reply, span))
        return reply

    return run(agent(task), answer), made


def run_rollout(task: dict[str, Any], base_url: str) -> float:
    """`harness.function`: play the rollout and return its reward (the runner emits it)."""
    outcome, _ = play_rollout(task, base_url)
    return outcome.reward


def main() -> int:
    raw_task, base_url = os.environ.get("AGL_TASK"), os.environ.get("OPENAI_BASE_URL")
    if not raw_task or not base_url:
        print(
            "hops harness: set AGL_TASK (the task as JSON) and OPENAI_BASE_URL; an agl runner sets both",
            file=sys.stderr,
        )
        return 2
    try:
        task = check_task(json.loads(raw_task))
    except (json.JSONDecodeError, ValueError, TypeError) as error:
        print(f"hops harness: AGL_TASK is not a valid hops task: {error}", file=sys.stderr)
        return 2
    import agl

    reward = run_rollout(task, base_url)
    agl.emit_reward(reward)
    print(f"reward {reward:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
