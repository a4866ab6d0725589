"""The scripted engine's answers: `--script FILE`, a YAML or JSON file of turns.

    turns:
      - tool_calls:                       # the first call: a tool call ...
          - name: Bash
            arguments: {command: "echo hello"}
      - content: "The command printed hello."   # ... the second: the answer
      - reasoning: "The user wants a greeting."   # thinking before the answer (a <think> block)
        content: "Hello!"
      - "A turn may also be a plain string: its content."

Each model call takes the next turn, in the order the calls reach the engine (a harness's side
calls, e.g. a title or a summary, take turns too: the report shows which answer each call got).
Once the turns are used up, and without a script, every call gets DEFAULT_ANSWER. A turn's
tool calls are answered with finish_reason `tool_calls`, whatever tools the request declared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

DEFAULT_ANSWER = "Hello from agl harness check's scripted engine. Everything is fine: you may stop here."


class ScriptError(ValueError):
    """The script file cannot be used; the message names the file, the place and the fix."""


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: dict[str, Any] = {}


class Turn(msgspec.Struct, forbid_unknown_fields=True):
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = []


class _File(msgspec.Struct, forbid_unknown_fields=True):
    turns: list[Turn | str]


DEFAULT_TURN = Turn(content=DEFAULT_ANSWER)


class Script:
    """The turns, handed out one per call; DEFAULT_TURN after the last."""

    def __init__(self, turns: list[Turn] | None = None) -> None:
        self.turns = list(turns or [])
        self.used = 0

    def next_turn(self) -> tuple[int | None, Turn]:
        """(the turn's index in the script, or None for the default answer; the turn)."""
        if self.used < len(self.turns):
            self.used += 1
            return self.used - 1, self.turns[self.used - 1]
        return None, DEFAULT_TURN


def load_script(path: Path) -> Script:
    """The script at `path` (YAML, of which JSON is a part); ScriptError naming what is wrong."""
    import yaml

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ScriptError(f"--script {path}: cannot read it ({error.strerror or error})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ScriptError(f"--script {path}: not YAML or JSON ({error})") from None
    try:
        parsed = msgspec.convert(raw, _File)
    except msgspec.ValidationError as error:
        raise ScriptError(
            f"--script {path}: {error} (fix: a mapping with `turns:`, a list of turns, each a string or a"
            " mapping of content, reasoning and tool_calls [{name, arguments}]; see `agl harness check --help`)"
        ) from None
    turns = [Turn(content=turn) if isinstance(turn, str) else turn for turn in parsed.turns]
    for index, turn in enumerate(turns):
        if not turn.content and not turn.tool_calls:
            raise ScriptError(f"--script {path}: turn {index} has neither content nor tool_calls (fix: give it one)")
        for call in turn.tool_calls:
            if not call.name:
                raise ScriptError(f"--script {path}: turn {index} has a tool call without a name")
    return Script(turns)
