"""The demo's harness, writing down the agl run id its rollout's process sees (AGL_RUN_ID) in the file
AGL_TEST_RUN_ID_LOG names, one line a rollout: what tests/eval/test_eval_demo.py checks `agl train`
and `agl eval` hand their harnesses."""

from __future__ import annotations

import os
from typing import Any

from examples.demo.harness import run_episode as demo_episode


def run_episode(task: dict[str, Any], base_url: str, **kwargs: Any) -> float:
    with open(os.environ["AGL_TEST_RUN_ID_LOG"], "a", encoding="utf-8") as log:
        log.write(os.environ.get("AGL_RUN_ID", "<unset>") + "\n")
    return demo_episode(task, base_url, **kwargs)
