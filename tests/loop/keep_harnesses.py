"""Harnesses for the keep-switch loop test, called as `tests.loop.keep_harnesses:NAME` in runner workers."""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def long_tail(task: dict[str, Any], base_url: str) -> float:
    """Two model calls of `task['tokens']` tokens each (EOS ignored, so lengths are what the task
    says), streamed when `task['stream']`; any HTTP error or malformed answer propagates."""
    total = 0
    for _ in range(2):
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
