"""The demo harness: a plain `openai` SDK program that makes two model calls with a tool in between.

As a script (what a runner's command starts, once per rollout):

    OPENAI_BASE_URL=http://127.0.0.1:PORT/rollouts/ID/v1 AGL_TASK='{"key": "k3", "table": {...}}' \\
        python examples/demo/harness.py

it reads the task from AGL_TASK, runs the episode and reports the reward with `agl.emit_reward`
(the runner sets AGL_ROLLOUT_ID and AGL_OTLP_ENDPOINT). Optional: AGL_MODEL (default `tiny`),
AGL_TEMPERATURE (default 1.0), OPENAI_API_KEY (any value).

As a function, for a runner that calls harnesses in-process (no `import openai` per rollout):

    from examples.demo.harness import run_episode, run_episode_async
    reward = run_episode(task, base_url)              # -> float; emits nothing by default
    reward = await run_episode_async(task, base_url)  # same, with AsyncOpenAI
    run_episode(task, base_url, emit=True)            # also agl.emit_reward(reward)

`base_url` is the OpenAI base URL including `/v1` (the sidecar's `/rollouts/{id}/v1`, or an
engine's `/v1` directly). The openai client is made once per process (per event loop for the async
one) and re-pointed per call with `with_options`, so its connection pool is shared.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import weakref
from typing import Any

if __package__ in (None, ""):  # run as a script: make `examples` importable from the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.demo import task as demo

DEFAULT_MODEL = "tiny"
_sync_root: Any = None
_async_roots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one client per event loop
_clients_lock = threading.Lock()


def _settings(task: dict[str, Any], model: str | None, temperature: float | None) -> tuple[str, float]:
    model = model or os.environ.get("AGL_MODEL") or task.get("model") or DEFAULT_MODEL
    if temperature is None:
        temperature = float(os.environ.get("AGL_TEMPERATURE") or task.get("temperature", 1.0))
    return model, temperature


def _sync_client(base_url: str) -> Any:
    from openai import OpenAI

    global _sync_root
    with _clients_lock:
        root = _sync_root
        if root is None:
            root = _sync_root = OpenAI(
                base_url=base_url,
                api_key=os.environ.get("OPENAI_API_KEY") or "agl",
                max_retries=0,
                timeout=300,
            )
    return root.with_options(base_url=base_url)


def _async_client(base_url: str) -> Any:
    import asyncio

    from openai import AsyncOpenAI

    loop = asyncio.get_running_loop()
    with _clients_lock:
        root = _async_roots.get(loop)
        if root is None:
            root = _async_roots[loop] = AsyncOpenAI(
                base_url=base_url,
                api_key=os.environ.get("OPENAI_API_KEY") or "agl",
                max_retries=0,
                timeout=300,
            )
    return root.with_options(base_url=base_url)


def _finish(task: dict[str, Any], call1: Any, call2: Any, emit: bool) -> float:
    reward = demo.episode_reward(task, call1, call2)
    if emit:
        import agl

        agl.emit_reward(reward)
    return reward


def _words(response: Any) -> list[str]:
    choice = response.choices[0]
    return demo.generated_words(choice.message.content, choice.finish_reason)


def run_episode(
    task: dict[str, Any],
    base_url: str,
    *,
    model: str | None = None,
    temperature: float | None = None,
    emit: bool = False,
) -> float:
    """Run one episode against an OpenAI-compatible endpoint and return its reward in [0, 1]."""
    demo.check_task(task)
    model, temperature = _settings(task, model, temperature)
    client = _sync_client(base_url)
    first = client.chat.completions.create(
        model=model,
        messages=demo.first_messages(task),
        max_tokens=demo.CALL1_MAX_TOKENS,
        temperature=temperature,
    )
    call_text = first.choices[0].message.content or ""
    second = client.chat.completions.create(
        model=model,
        messages=demo.second_messages(task, call_text, demo.run_tool(task, call_text)),
        max_tokens=demo.CALL2_MAX_TOKENS,
        temperature=temperature,
    )
    return _finish(task, _words(first), _words(second), emit)


async def run_episode_async(
    task: dict[str, Any],
    base_url: str,
    *,
    model: str | None = None,
    temperature: float | None = None,
    emit: bool = False,
) -> float:
    """`run_episode` with `openai.AsyncOpenAI`, for runners that keep many episodes on one loop."""
    demo.check_task(task)
    model, temperature = _settings(task, model, temperature)
    client = _async_client(base_url)
    first = await client.chat.completions.create(
        model=model,
        messages=demo.first_messages(task),
        max_tokens=demo.CALL1_MAX_TOKENS,
        temperature=temperature,
    )
    call_text = first.choices[0].message.content or ""
    second = await client.chat.completions.create(
        model=model,
        messages=demo.second_messages(task, call_text, demo.run_tool(task, call_text)),
        max_tokens=demo.CALL2_MAX_TOKENS,
        temperature=temperature,
    )
    return _finish(task, _words(first), _words(second), emit)


def main() -> int:
    raw_task, base_url = os.environ.get("AGL_TASK"), os.environ.get("OPENAI_BASE_URL")
    if not raw_task or not base_url:
        print(
            "demo harness: set AGL_TASK (the task as JSON) and OPENAI_BASE_URL (e.g. "
            "http://127.0.0.1:8000/v1); an agl runner sets both",
            file=sys.stderr,
        )
        return 2
    try:
        task = demo.check_task(json.loads(raw_task))
    except (json.JSONDecodeError, ValueError, TypeError) as error:
        print(f"demo harness: AGL_TASK is not a valid demo task: {error}", file=sys.stderr)
        return 2
    reward = run_episode(task, base_url, emit=True)
    print(f"reward {reward:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
