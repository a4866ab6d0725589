"""Harness functions for the runner tests, called as `tests.loop.harnesses:NAME` in runner workers."""

from __future__ import annotations

import json
import re
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
    step) before the second call, so the rollout's calls are served by two policy versions. Those
    rollouts mark their first call done in the folder task['firsts']; tasks with `after_firsts` (N)
    make their second call only once N are marked, so no step comes before the first calls."""
    first = _chat(base_url)
    release = task.get("release")
    if release:
        rollout_id = base_url.split("/rollouts/")[1].split("/")[0]
        open(os.path.join(task["firsts"], rollout_id), "w").close()
        wait_for([release])
    elif task.get("after_firsts"):
        deadline = time.monotonic() + 120
        while len(os.listdir(task["firsts"])) < task["after_firsts"] and time.monotonic() < deadline:
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


def group_of(base_url: str) -> int:
    """The launch index of the rollout's group, from its id in the URL (`...-g000003-1/...`)."""
    return int(re.search(r"-g(\d{6})-\d+", base_url).group(1))  # type: ignore[union-attr]


def reward_of(rollout_id_or_url: str) -> float:
    """A reward that differs within and across groups, derived from the rollout id alone: a test compares
    it with the rewards each step trained."""
    group, member = re.search(r"-g(\d{6})-(\d+)", rollout_id_or_url).groups()  # type: ignore[union-attr]
    return (int(member) % 2) * 0.5 + (int(group) % 2) * 0.25


def across_steps(task: dict[str, Any], base_url: str) -> float:
    """The first group (launch index 0) makes a call under each of the first three policy versions: one
    call, then one after each of the files `release`/r1 and r2 appears (the test writes them after steps
    1 and 2). Every other group makes two calls at once; with task['gate'], groups from index 3 on
    first wait for the first group's harnesses to end (so that it completes before them)."""
    release, group = task["release"], group_of(base_url)
    if group == 0:
        _chat(base_url)
        for name in ("r1", "r2"):
            wait_for([os.path.join(release, name)])
            _chat(base_url)
        open(os.path.join(release, f"done-{base_url.split('-g000000-')[1].split('/')[0]}"), "w").close()
    else:
        if task.get("gate") and group >= 3:
            wait_for([os.path.join(release, f"done-{member}") for member in range(4)])
        _chat(base_url)
        _chat(base_url)
    return reward_of(base_url)


def wait_for(paths: list[str], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.02)


def flat_or_mixed(task: dict[str, Any], base_url: str) -> float:
    """One model call; a task with `reward` gives every rollout that reward (a flat group), any other
    task gives its group's members 0 and 1 by member index (a group with something to learn)."""
    _chat(base_url)
    if "reward" in task:
        return float(task["reward"])
    return float(int(re.search(r"-g\d{6}-(\d+)", base_url).group(1)) % 2)  # type: ignore[union-attr]
