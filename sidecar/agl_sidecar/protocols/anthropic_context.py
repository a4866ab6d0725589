"""Anthropic's context editing (`context_management.edits`), applied by the sidecar as the API applies
it: before the prompt reaches the model, on the request's messages, the harness keeping its full
history. The edits here clear content; compaction (`compact_20260112`) is anthropic_compaction.py.

- `clear_thinking_20251015`: thinking blocks of all but the `keep` most recent assistant turns are
  removed (`keep`: `{"type": "thinking_turns", "value": N}`, `{"type": "all"}` or `"all"`; default one
  turn). With thinking on and no such edit, the API keeps the last turn's thinking only, and so
  does the sidecar. A turn runs from one user message to the next, a tool loop within it.
- `clear_tool_uses_20250919`: once the prompt exceeds `trigger` (`input_tokens`, default 100,000, or
  `tool_uses`), the results of all but the `keep` most recent tool uses (default 3) become a
  placeholder, oldest first; `exclude_tools` are never cleared; `clear_tool_inputs` (true, or tool
  names) empties those calls' inputs too; with `clear_at_least` nothing is cleared unless at least
  that many input tokens go.

What each edit cleared is reported as the API reports it (`context_management.applied_edits`: turns
or tool uses and input tokens cleared, counted with the engine's tokenizer). An edited prompt no
longer extends the previous call's tokens; the call says so (Translation.context_edits -> the
span's agl.call.context_edits), and assembly starts a sample there named as a context edit rather
than a merge failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from agl_sidecar.protocols._checks import FieldFates, check, refuse, unknown_keys

CLEAR_THINKING = "clear_thinking_20251015"
CLEAR_TOOL_USES = "clear_tool_uses_20250919"
COMPACT = "compact_20260112"
# What a cleared tool result says instead (Claude Code's own placeholder for what it clears).
CLEARED_RESULT = "[Old tool result content cleared]"

Positive = Annotated[int, msgspec.Meta(ge=1)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class InputTokens(msgspec.Struct, tag="input_tokens", tag_field="type"):
    value: Positive


class ToolUses(msgspec.Struct, tag="tool_uses", tag_field="type"):
    value: Count


class ThinkingTurns(msgspec.Struct, tag="thinking_turns", tag_field="type"):
    value: Count


class AllTurns(msgspec.Struct, tag="all", tag_field="type"):
    pass


class ClearThinking(msgspec.Struct, tag=CLEAR_THINKING, tag_field="type"):
    keep: ThinkingTurns | AllTurns | Literal["all"] | None = None


class ClearToolUses(msgspec.Struct, tag=CLEAR_TOOL_USES, tag_field="type"):
    trigger: InputTokens | ToolUses | None = None
    keep: ToolUses | None = None
    clear_at_least: InputTokens | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None


class Compact(msgspec.Struct, tag=COMPACT, tag_field="type"):
    trigger: InputTokens | None = None
    pause_after_compaction: bool = False
    instructions: str | None = None


EDITS: dict[str, type[msgspec.Struct]] = {CLEAR_THINKING: ClearThinking, CLEAR_TOOL_USES: ClearToolUses, COMPACT: Compact}


@dataclass
class Plan:
    """The edits a request asks for, checked (at most one of each type, as the API takes them)."""

    clear_thinking: ClearThinking | None = None
    clear_tool_uses: ClearToolUses | None = None
    compact: Compact | None = None
    default_thinking: bool = False  # thinking on, no clear_thinking edit: keep the last turn's


def plan(body: dict[str, Any], fates: FieldFates) -> Plan:
    """The checked edits of `body["context_management"]`; an edit of a type the sidecar does not
    implement is dropped (and written down), a known one with a wrong option is a 400."""
    found = Plan()
    config = body.get("context_management")
    if isinstance(config, dict):
        edits = config.get("edits") or []
        if not isinstance(edits, list):
            raise refuse("Input should be a valid array", "context_management.edits")
        for key in config:
            if key != "edits":
                fates.drop(f"context_management.{key}", "not a field the sidecar knows")
        for i, edit in enumerate(edits):
            at = f"context_management.edits[{i}]"
            kind = edit.get("type") if isinstance(edit, dict) else None
            struct = EDITS.get(kind) if isinstance(kind, str) else None
            if struct is None:
                fates.drop(at, f"an edit of type {kind!r} the sidecar does not implement")
                continue
            for key in unknown_keys(edit, struct, also=("type",)):
                fates.drop(f"{at}.{key}", f"not an option of {kind}")
            name = {CLEAR_THINKING: "clear_thinking", CLEAR_TOOL_USES: "clear_tool_uses", COMPACT: "compact"}[kind]
            setattr(found, name, check(edit, struct, at))
    thinking = body.get("thinking")
    enabled = isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled")
    found.default_thinking = enabled and found.clear_thinking is None
    return found


def thinking_turns_kept(edit: ClearThinking | None) -> int | None:
    """How many recent assistant turns keep their thinking (None: all)."""
    keep = edit.keep if edit is not None else None
    if keep is None:
        return 1
    if isinstance(keep, ThinkingTurns):
        return keep.value
    return None  # "all", {"type": "all"}


def clear_thinking(messages: list[dict[str, Any]], keep: int | None) -> tuple[list[dict[str, Any]], int]:
    """`messages` without the thinking blocks of all but the `keep` most recent assistant turns, and
    how many turns lost theirs (0: `messages` itself is returned). A turn is what the assistant says
    between two user messages, its tool loop included (a user message of tool results only does not
    end it), so a tool loop keeps its thinking within the turn."""
    if keep is None:
        return messages, 0
    turn, turn_of = 0, {}
    for i, message in enumerate(messages):
        if message["role"] == "user" and not _tool_results_only(message["content"]):
            turn += 1
        elif message["role"] == "assistant":
            turn_of[i] = turn
    turns = sorted(set(turn_of.values()))
    old = set(turns[: max(0, len(turns) - keep)])
    out, cleared = [], set()
    for i, message in enumerate(messages):
        content = message["content"]
        if turn_of.get(i) in old and isinstance(content, list) and any(b["type"] == "thinking" for b in content):
            kept = [b for b in content if b["type"] != "thinking"]
            cleared.add(turn_of[i])
            if not kept:
                continue  # nothing but thinking: the message goes
            message = {**message, "content": kept}
        out.append(message)
    return (out, len(cleared)) if cleared else (messages, 0)


def _tool_results_only(content: str | list[dict[str, Any]]) -> bool:
    return isinstance(content, list) and bool(content) and all(b["type"] == "tool_result" for b in content)


def count_tool_uses(messages: list[dict[str, Any]]) -> int:
    return sum(1 for _, _, block in _tool_uses(messages))


def clear_tool_uses(messages: list[dict[str, Any]], edit: ClearToolUses) -> tuple[list[dict[str, Any]], int]:
    """`messages` with the results of all but the `keep` most recent tool uses cleared (and their
    inputs, per `clear_tool_inputs`), and how many were cleared (0: `messages` itself)."""
    keep = edit.keep.value if edit.keep is not None else 3
    excluded = set(edit.exclude_tools or ())
    uses = [(i, j, b) for i, j, b in _tool_uses(messages) if b["name"] not in excluded]
    cleared = uses[: max(0, len(uses) - keep)]
    if not cleared:
        return messages, 0
    inputs = edit.clear_tool_inputs
    ids = {b["id"] for _, _, b in cleared}
    empty_inputs = {
        b["id"] for _, _, b in cleared if inputs is True or (isinstance(inputs, list) and b["name"] in inputs)
    }
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list) and any(_clears(b, ids, empty_inputs) for b in content):
            content = [_cleared(b, ids, empty_inputs) for b in content]
            message = {**message, "content": content}
        out.append(message)
    return out, len(cleared)


def _tool_uses(messages: list[dict[str, Any]]) -> list[tuple[int, int, dict[str, Any]]]:
    return [
        (i, j, block)
        for i, message in enumerate(messages)
        if message["role"] == "assistant" and isinstance(message["content"], list)
        for j, block in enumerate(message["content"])
        if block["type"] == "tool_use"
    ]


def _clears(block: dict[str, Any], ids: set[str], empty_inputs: set[str]) -> bool:
    return (block["type"] == "tool_result" and block["tool_use_id"] in ids) or (
        block["type"] == "tool_use" and block["id"] in empty_inputs
    )


def _cleared(block: dict[str, Any], ids: set[str], empty_inputs: set[str]) -> dict[str, Any]:
    if block["type"] == "tool_result" and block["tool_use_id"] in ids:
        return {**block, "content": CLEARED_RESULT}
    if block["type"] == "tool_use" and block["id"] in empty_inputs:
        return {**block, "input": {}}
    return block


@dataclass
class Applied:
    """The edits applied so far, as the response's `context_management.applied_edits` lists them."""

    edits: list[dict[str, Any]] = field(default_factory=list)

    def add(self, kind: str, unit: str, cleared: int, tokens: int) -> None:
        self.edits.append({"type": kind, f"cleared_{unit}": cleared, "cleared_input_tokens": max(0, tokens)})

    def types(self) -> tuple[str, ...]:
        return tuple(edit["type"] for edit in self.edits)
