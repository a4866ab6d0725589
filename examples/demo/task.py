"""The demo task: look a key up with a tool, then answer the value the tool returned.

One episode is two model calls:

    user:      k3
    assistant: call k3            <- call 1 (max 3 tokens: `call`, the key, <|im_end|>)
    tool:      v5                 <- the tool reads this episode's table (drawn per task)
    assistant: v5                 <- call 2 (max 2 tokens: the value, <|im_end|>)

The tool call is plain text (`call <key>`) rather than an OpenAI `tool_calls` object: a 26-word
model emits it reliably, the chat template renders it back to the same tokens, and the harness
still sends the tool's answer back as a `tool` message, as a real tool-using harness does.

Reward: the fraction of the 5 generated positions that are right (a uniform random policy gets
about 0.04). Everything here is plain Python (no torch, no openai) so the harness, the warm start
and the in-process reference share one definition of the task.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

N_KEYS = 8
N_VALUES = 8
KEYS = tuple(f"k{i}" for i in range(N_KEYS))
VALUES = tuple(f"v{i}" for i in range(N_VALUES))
CALL = "call"
NO_VALUE = "none"  # what the tool answers for a key not in the table
EOS = "<|im_end|>"  # the word-level tokenizer's end-of-turn token, as the harness counts positions
WORDS = (CALL, *KEYS, *VALUES, NO_VALUE)  # the demo vocabulary, beyond specials and role names
CALL1_MAX_TOKENS = 3
CALL2_MAX_TOKENS = 2
POSITIONS = CALL1_MAX_TOKENS + CALL2_MAX_TOKENS
TOOL_CALL_ID = "lookup-1"


def make_task(rng: random.Random, index: int) -> dict[str, Any]:
    """One task: a key to look up and this task's table (every key -> a random value)."""
    return {
        "task_id": f"demo-{index:05d}",
        "key": rng.choice(KEYS),
        "table": {key: rng.choice(VALUES) for key in KEYS},
    }


def make_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` tasks, the same ones for the same seed."""
    if n < 1:
        raise ValueError(f"make_tasks: n must be >= 1, got {n}")
    rng = random.Random(seed)
    return [make_task(rng, index) for index in range(n)]


def write_tasks(path: str | Path, n: int, seed: int = 0) -> Path:
    """Write `n` seeded tasks as JSONL (one task per line) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(task) + "\n" for task in make_tasks(n, seed)))
    return path


def check_task(task: Any) -> dict[str, Any]:
    """The task, or a ValueError that says which field is wrong."""
    if not isinstance(task, dict):
        raise TypeError(f"demo task: expected a JSON object, got {type(task).__name__}")
    key, table = task.get("key"), task.get("table")
    if not isinstance(key, str) or not key:
        raise ValueError(f"demo task: 'key' must be a non-empty string, got {key!r}")
    if not isinstance(table, dict) or key not in table:
        raise ValueError(f"demo task: 'table' must be an object that holds the key {key!r}")
    return task


def first_messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": task["key"]}]


def second_messages(task: dict[str, Any], call_text: str, tool_answer: str) -> list[dict[str, Any]]:
    return [
        *first_messages(task),
        {"role": "assistant", "content": call_text},
        {"role": "tool", "tool_call_id": TOOL_CALL_ID, "content": tool_answer},
    ]


def run_tool(task: dict[str, Any], call_text: str) -> str:
    """The lookup tool: `call <key>` answers the table's value for that key, anything else `none`."""
    words = call_text.split()
    if len(words) >= 2 and words[0] == CALL:
        return task["table"].get(words[1], NO_VALUE)
    return NO_VALUE


def expected_call(task: dict[str, Any]) -> list[str]:
    return [CALL, task["key"], EOS]


def expected_answer(task: dict[str, Any]) -> list[str]:
    return [task["table"][task["key"]], EOS]


def generated_words(content: str | None, finish_reason: str | None) -> list[str]:
    """The generated positions as words: the text's words, plus EOS when the model stopped itself."""
    words = (content or "").split()
    return words + [EOS] if finish_reason == "stop" else words


def matches(generated: Sequence[str], expected: Sequence[str]) -> int:
    return sum(1 for got, want in zip(generated, expected) if got == want)


def episode_reward(task: dict[str, Any], call1: Sequence[str], call2: Sequence[str]) -> float:
    """Fraction of the 5 positions right, given each call's generated words (see generated_words)."""
    return (matches(call1, expected_call(task)) + matches(call2, expected_answer(task))) / POSITIONS
