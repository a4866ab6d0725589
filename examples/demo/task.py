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
about 0.04).

Held out by construction: all the model sees of an episode is the key and the tool's value, so a
held-out task is one whose (key, value) pair training never shows. A pair's split is fixed by its
offset (value index - key index) mod N_VALUES (`split_of`): every key and every value is in
training, each with half the values or keys, but never with its held-out partners, and no training
table holds a held-out pair under any key (a wrong lookup cannot show it either). What a held-out
task measures is whether copying the tool's value carries over to pairs never seen together.

Everything here is plain Python (no torch, no openai) so the harness, the warm start and the
in-process reference share one definition of the task.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

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

Split = Literal["train", "val", "test"]
SPLITS: tuple[Split, ...] = ("train", "val", "test")
# (value index - key index) mod N_VALUES of the held-out pairs: `val` for choosing settings, `test`
# for reporting (never for choosing); every other offset is training's (4 of each key's 8 values)
HELD_OUT_OFFSETS: dict[Split, tuple[int, ...]] = {"val": (2, 3), "test": (6, 7)}
ID_PREFIX: dict[Split, str] = {"train": "demo", "val": "val", "test": "test"}


def split_of(key: str, value: str) -> Split:
    """The split a (key, value) pair belongs to."""
    offset = (VALUES.index(value) - KEYS.index(key)) % N_VALUES
    return next((split for split, held in HELD_OUT_OFFSETS.items() if offset in held), "train")


def values_for(key: str, split: Split) -> tuple[str, ...]:
    """The values `key` may have in a task of `split` (never empty)."""
    return tuple(value for value in VALUES if split_of(key, value) == split)


def check_split(split: str) -> Split:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    return split  # type: ignore[return-value]


def split_pairs(split: Split) -> list[tuple[str, str]]:
    """Every (key, value) pair of `split`, in a fixed order."""
    return [(key, value) for key in KEYS for value in values_for(key, split)]


def make_task(
    rng: random.Random, index: int, split: Split = "train", pair: tuple[str, str] | None = None
) -> dict[str, Any]:
    """One task of `split`: a key to look up (with its value: `pair`, else drawn) and this task's
    table. Every other entry holds a training pair, so a wrong lookup shows a training pair too."""
    key, value = pair or (rng.choice(KEYS), None)
    table = {k: rng.choice(values_for(k, "train")) for k in KEYS}
    table[key] = value or rng.choice(values_for(key, split))
    if split_of(key, table[key]) != split:
        found = split_of(key, table[key])
        raise ValueError(f"make_task: ({key}, {table[key]}) is a {found} pair, not a {split} pair")
    return {"task_id": f"{ID_PREFIX[split]}-{index:05d}", "key": key, "table": table}


def make_tasks(n: int, seed: int = 0, split: Split = "train") -> list[dict[str, Any]]:
    """`n` tasks of `split`, the same ones for the same seed. Held-out tasks go through their
    split's pairs in a seeded order, so `n` >= the pairs' count measures each of them."""
    if n < 1:
        raise ValueError(f"make_tasks: n must be >= 1, got {n}")
    rng = random.Random(seed)
    if check_split(split) == "train":
        return [make_task(rng, index) for index in range(n)]
    pairs = split_pairs(split)
    rng.shuffle(pairs)
    return [make_task(rng, index, split, pairs[index % len(pairs)]) for index in range(n)]


def write_tasks(path: str | Path, n: int, seed: int = 0, split: Split = "train") -> Path:
    """Write `n` seeded tasks of `split` as JSONL (one task per line) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(task) + "\n" for task in make_tasks(n, seed, split)))
    return path


def shown_pairs(tasks: Sequence[dict[str, Any]]) -> set[tuple[str, str]]:
    """Every (key, value) pair an episode of these tasks can show the model: any key it may look
    up, with that key's value in its table."""
    return {(key, value) for task in tasks for key, value in task["table"].items()}


def answer_pair(task: dict[str, Any]) -> tuple[str, str]:
    """What the model sees that decides a task's answer: its key and the key's value."""
    return task["key"], task["table"][task["key"]]


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
