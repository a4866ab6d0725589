"""Fixtures for the real-harness tests: the pinned CLIs (testing/clis), and a tokenizer trained on
what Claude Code sends, for the scripted engine (support.py)."""

from __future__ import annotations

from typing import Any

import pytest

from agl_testing.clis import Cli, installed_cli
from tests.harnesses.support import agent_tokenizer, captured
from tests.support.required import requires

CLAUDE = installed_cli("claude")


def claude_texts() -> list[str]:
    """Every text Claude Code 2.1.328 sent in the captures (system prompt, tool schemas, messages)."""
    import json

    texts: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)

    for scenario in ("tool_loop", "subagents", "compaction"):
        for request in captured(scenario):
            walk(request["body"]["messages"])
            walk(request["body"]["system"])
            texts += [json.dumps({"type": "function", "function": tool}) for tool in request["body"]["tools"]]
    return texts


@pytest.fixture(scope="session")
def claude_cli() -> Cli:
    if isinstance(CLAUDE, str):
        pytest.skip(CLAUDE)
    return CLAUDE


@pytest.fixture(scope="session")
def cc_tokenizer() -> Any:
    return agent_tokenizer(claude_texts())


needs_claude = requires(not isinstance(CLAUDE, str), CLAUDE if isinstance(CLAUDE, str) else "")
