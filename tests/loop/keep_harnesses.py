"""Harnesses for the keep-switch loop test, called as `tests.loop.keep_harnesses:NAME` in runner workers."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path
from typing import Any

from tests.loop.harnesses import wait_for

HOLD_S = 600.0  # at most this long held (the test's harness.timeout_s allows it): only a hang guard


def long_tail(task: dict[str, Any], base_url: str) -> float:
    """Two model calls of `task['tokens']` tokens each (EOS ignored, so lengths are what the task
    says), streamed when `task['stream']`; any HTTP error or malformed answer propagates. With
    `task['hold']` (a directory), the run's first rollout to reach its second call waits for
    `<hold>/go` before making it: a call the test can count on being still to come."""
    total = 0
    for call in range(2):
        if call == 1 and task.get("hold") and first_to_hold(Path(task["hold"])):
            wait_for([str(Path(task["hold"]) / "go")], timeout_s=HOLD_S)
        body = {
            "model": "tiny", "messages": [{"role": "user", "content": task.get("key", "k1")}],
            "max_tokens": int(task["tokens"]), "ignore_eos": True, "stream": bool(task.get("stream")),
        }  # fmt: skip
        request = urllib.request.Request(
            base_url + "/chat/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            if body["stream"]:
                chunks = [json.loads(line[6:]) for line in response.read().decode().splitlines() if line.startswith("data: {")]
                text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            else:
                text = json.loads(response.read())["choices"][0]["message"]["content"] or ""
        total += len(text)
    return float(total % 3) / 2.0


def first_to_hold(hold: Path) -> bool:
    """Whether this rollout is the first to claim `hold` (an exclusive create: one rollout across processes)."""
    try:
        os.close(os.open(hold / "held", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
