"""Harness functions for the runner tests, called as `tests.loop.harnesses:NAME` in runner workers."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from typing import Any


def record(task: dict[str, Any], base_url: str) -> float:
    """Writes what it was given to task['out'] and returns task['reward']."""
    with open(task["out"], "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"task": task, "base_url": base_url, "pid": os.getpid()}) + "\n")
    return float(task.get("reward", 0.5))


def crash(task: dict[str, Any], base_url: str) -> float:
    raise ValueError(f"harness bug on task {task['id']}")


def hang(task: dict[str, Any], base_url: str) -> None:
    time.sleep(float(task.get("sleep", 30)))


def die(task: dict[str, Any], base_url: str) -> None:
    """The worker process dies under the harness (an infrastructure failure)."""
    marker = task["marker"]
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(9)


async def async_record(task: dict[str, Any], base_url: str) -> float:
    return record(task, base_url)


def chat(task: dict[str, Any], base_url: str) -> float:
    """Calls the model through base_url with the plain standard library, twice."""
    for _ in range(2):
        request = urllib.request.Request(
            base_url + "/chat/completions",
            data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            json.loads(response.read())
    return 1.0


not_callable = 3


def _chat(base_url: str, content: str = "k1") -> dict[str, Any]:
    request = urllib.request.Request(
        base_url + "/chat/completions",
        data=json.dumps(
            {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 3}
        ).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def calls(task: dict[str, Any], base_url: str) -> float:
    """`task['calls']` model calls with a short tool pause between; reward from the answer text.
    Any HTTP error propagates (the rollout fails as a harness error, which tests look for)."""
    words = []
    for _ in range(int(task.get("calls", 2))):
        reply = _chat(base_url, task.get("key", "k1"))
        words.append(reply["choices"][0]["message"]["content"] or "")
        time.sleep(float(task.get("tool_s", 0.02)))
    return float(sum(len(w) for w in words) % 3) / 2.0


def spanning(task: dict[str, Any], base_url: str) -> float:
    """One call; for tasks with `release`, wait for that file (the test creates it after a training
    step) before the second call, so the rollout's calls are served by two policy versions."""
    first = _chat(base_url)
    release = task.get("release")
    if release:
        deadline = time.monotonic() + 120
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.02)
    second = _chat(base_url)
    return float(len(first["choices"][0]["message"]["content"] or "") % 2) + float(
        len(second["choices"][0]["message"]["content"] or "") % 2
    ) / 2


def flaky(task: dict[str, Any], base_url: str) -> float:
    """Crashes or hangs on the tasks that say so; otherwise a normal two-call rollout."""
    if task.get("crash"):
        raise RuntimeError("this harness crashed")
    if task.get("hang"):
        time.sleep(60)
    return calls(task, base_url)


def die_mid_traffic(task: dict[str, Any], base_url: str) -> None:
    """One call kills its worker while the worker's other threads are sending results (errors of
    `error_bytes` each, which take a while to write)."""
    marker = task["marker"]
    if task["id"].endswith("-7") and not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(0.05)  # let the other threads get to their results
        os._exit(9)
    raise ValueError("x" * task["error_bytes"])
