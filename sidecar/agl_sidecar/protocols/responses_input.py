"""Responses input items as chat messages, so that what the engine wrote renders back as it wrote it.

An assistant turn comes back as the items the sidecar answered with: a `reasoning` item, a
`message`, then `function_call` items; they become one assistant message (`reasoning`, `content`,
`tool_calls`), which the engine's chat template renders as the text the engine generated, so the
next prompt extends the last call token for token. The reasoning text comes from the sidecar's own
`encrypted_content` (responses_tokens.py) when the harness carried it back (Codex, with `store:
false`), else from the item's `reasoning_text` content.

Other items: user, system and developer messages (`developer` as `system`: open models' templates
do not know it); a role the sidecar does not know goes to the engine as written; function and
custom tool outputs as `tool` messages; a `compaction` item the sidecar made as a user message
holding its summary; a `compaction_trigger` asks the sidecar to compact (responses_compaction.py).
Items of hosted tools (web search calls, ...) and item types the sidecar does not know are dropped,
and the span names each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from agl_sidecar.protocols._checks import check, refuse
from agl_sidecar.protocols.responses_compaction import summary_message
from agl_sidecar.protocols.responses_fates import NOT_HELD, PASSED_AS_WRITTEN, UNKNOWN, Fates
from agl_sidecar.protocols.responses_request import (
    ITEMS,
    KNOWN_ROLES,
    PARTS,
    Compaction,
    CustomToolCall,
    CustomToolCallOutput,
    FunctionCall,
    FunctionCallOutput,
    InputFile,
    InputImage,
    Message,
    Reasoning,
    Refusal,
)
from agl_sidecar.protocols.responses_tokens import COMPACTION, REASONING, unseal
from agl_sidecar.protocols.responses_tools import ToolTable, engine_name

# Items of OpenAI's hosted tools (and of its stored state): known, and not the engine's to see.
HOSTED_ITEMS = frozenset((
    "web_search_call", "file_search_call", "computer_call", "computer_call_output", "image_generation_call",
    "code_interpreter_call", "local_shell_call", "local_shell_call_output", "mcp_call", "mcp_list_tools",
    "mcp_approval_request", "mcp_approval_response", "tool_search_call", "tool_search_output", "shell_call",
    "shell_call_output", "apply_patch_call", "apply_patch_call_output", "item_reference",
))  # fmt: skip
_HOSTED_ITEM = "an item of a hosted tool or of OpenAI's stored state; the engine has no use for it"
_MODEL_OUTPUT = frozenset(("function_call", "custom_tool_call", "reasoning"))
_KNOWN_KEYS = {kind: frozenset(struct.__struct_fields__) for kind, struct in {**ITEMS, **PARTS}.items()}
_encode = msgspec.json.Encoder().encode


@dataclass(slots=True)
class Input:
    messages: list[dict[str, Any]] = field(default_factory=list)
    # A compaction_trigger item: the harness asks the sidecar to compact its context.
    compaction_request: bool = False
    # The input holds a compaction no model output follows yet: the first call on a compacted context.
    after_compaction: bool = False


class _Builder:
    """Chat messages in order; the assistant message of one response is built from several items."""

    def __init__(self, tools: ToolTable, fates: Fates) -> None:
        self.tools, self.fates = tools, fates
        self.out = Input()
        self.assistant: dict[str, Any] | None = None
        self.reasoning: str | None = None  # read from a reasoning item, for the assistant message after it

    def add(self, message: dict[str, Any]) -> None:
        self.close()
        self.out.messages.append(message)

    def open_assistant(self, fresh: bool = False) -> dict[str, Any]:
        """The assistant message being built; a new one if `fresh` or none is open."""
        if self.assistant is not None and fresh:
            self.close()
        if self.assistant is None:
            self.assistant = self._new_assistant()
        return self.assistant

    def _new_assistant(self) -> dict[str, Any]:
        assistant: dict[str, Any] = {"role": "assistant", "content": None}
        if self.reasoning is not None:
            # vLLM 0.32 reads `reasoning` (and hands templates both); older servers and templates
            # given the messages as they are read `reasoning_content`.
            assistant["reasoning"] = assistant["reasoning_content"] = self.reasoning
            self.reasoning = None
        return assistant

    def close(self) -> None:
        if self.assistant is None and self.reasoning is not None:  # reasoning and no answer after it
            self.assistant = self._new_assistant()
        if self.assistant is not None:
            self.out.messages.append(self.assistant)
            self.assistant = None


def translate_input(items: str | list[dict[str, Any]], tools: ToolTable, fates: Fates) -> Input:
    """`items` as chat messages; ProtocolError(400) for a known item that is malformed."""
    if isinstance(items, str):
        return Input([{"role": "user", "content": items}])
    build = _Builder(tools, fates)
    last_compaction = -1
    for i, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        if not isinstance(kind, str):
            raise refuse("an input item needs a string `type` (or a `role`, for a message)", f"input[{i}].type")
        struct = ITEMS.get(kind)
        if struct is None:
            build.fates.drop("input[{}]", f"{kind}: {_HOSTED_ITEM if kind in HOSTED_ITEMS else UNKNOWN}", i)
            continue
        value = check(item, struct, f"input[{i}]")
        _note_unknown_keys(item, kind, "input[{}]", fates, i)
        if kind == "compaction":
            last_compaction = i
        elif last_compaction >= 0 and (kind in _MODEL_OUTPUT or (kind == "message" and value.role == "assistant")):
            last_compaction = -1  # the model already answered on the compacted context
        _ITEM[kind](build, value, i)
    build.close()
    build.out.after_compaction = last_compaction >= 0
    return build.out


def _message(build: _Builder, item: Message, i: int) -> None:
    content = _content(item.content, build.fates, "input[{}].content", i)
    if item.role == "assistant":
        open_one = build.assistant
        answered = open_one is not None and (open_one["content"] is not None or "tool_calls" in open_one)
        build.open_assistant(fresh=answered)["content"] = content
        return
    if item.role not in KNOWN_ROLES:
        build.fates.passed("input[{}].role", f"{item.role}: {PASSED_AS_WRITTEN}", i)
    build.add({"role": "system" if item.role == "developer" else item.role, "content": content})


def _function_call(build: _Builder, item: FunctionCall, i: int) -> None:
    call = {"id": item.call_id, "type": "function",
            "function": {"name": engine_name(item.name, item.namespace), "arguments": item.arguments}}  # fmt: skip
    build.open_assistant().setdefault("tool_calls", []).append(call)


def _custom_tool_call(build: _Builder, item: CustomToolCall, i: int) -> None:
    # The engine called the tool as a function of one string `input` (responses_tools.py); its own
    # spelling of those arguments is not in the item, so this is the compact JSON of them.
    arguments = _encode({"input": item.input}).decode()
    call = {"id": item.call_id, "type": "function",
            "function": {"name": engine_name(item.name, item.namespace), "arguments": arguments}}  # fmt: skip
    build.open_assistant().setdefault("tool_calls", []).append(call)


def _tool_output(build: _Builder, item: FunctionCallOutput | CustomToolCallOutput, i: int) -> None:
    output = item.output
    if not isinstance(output, str):
        output = _content(output, build.fates, "input[{}].output", i)
    build.add({"role": "tool", "tool_call_id": item.call_id, "content": output})


def _reasoning(build: _Builder, item: Reasoning, i: int) -> None:
    text = None
    if item.encrypted_content is not None:
        text = unseal(item.encrypted_content, REASONING)
        if text is None:
            build.fates.drop("input[{}].encrypted_content", NOT_HELD, i)
    if text is None and item.content:
        text = "".join(part.get("text") or "" for part in item.content if part.get("type") == "reasoning_text")
    if item.summary:
        build.fates.drop("input[{}].summary", "not what the model wrote; the engine is given its reasoning", i)
    if build.assistant is not None:
        build.close()  # a reasoning item starts the next response's output
    if text:
        build.reasoning = (build.reasoning or "") + text


def _compaction(build: _Builder, item: Compaction, i: int) -> None:
    summary = unseal(item.encrypted_content, COMPACTION)
    if summary is None:
        build.fates.drop("input[{}]", f"compaction: {NOT_HELD}", i)
        return
    build.add(summary_message(summary))


def _compaction_trigger(build: _Builder, item: Any, i: int) -> None:
    build.out.compaction_request = True


_ITEM = {
    "message": _message,
    "function_call": _function_call,
    "custom_tool_call": _custom_tool_call,
    "function_call_output": _tool_output,
    "custom_tool_call_output": _tool_output,
    "reasoning": _reasoning,
    "compaction": _compaction,
    "compaction_trigger": _compaction_trigger,
}


def _content(content: str | list[dict[str, Any]], fates: Fates, where: str, i: int) -> Any:
    """A message's (or tool output's) content as chat content, one text part as a string (`where`:
    its path with `{}` for the item's index `i`)."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    at, path = where.format(i), where + "[{}]"
    for j, part in enumerate(content):
        kind = part.get("type")
        struct = PARTS.get(kind) if isinstance(kind, str) else None
        if struct is None:
            if not isinstance(kind, str):
                raise refuse("a content part needs a string `type`", f"{at}[{j}].type")
            fates.drop(path, f"{kind}: {UNKNOWN}", i, j)
            continue
        value = check(part, struct, f"{at}[{j}]")
        _note_unknown_keys(part, kind, path, fates, i, j)
        chat = _part(value, path, fates, i, j)
        if chat is not None:
            parts.append(chat)
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


def _part(part: Any, path: str, fates: Fates, *at: int) -> dict[str, Any] | None:
    if isinstance(part, Refusal):
        return {"type": "text", "text": part.refusal}
    if isinstance(part, InputImage):
        if part.image_url is None:
            fates.drop(path, "an image by file_id: the sidecar cannot fetch OpenAI's files", *at)
            return None
        image: dict[str, Any] = {"url": part.image_url}
        if part.detail in ("low", "high", "auto"):
            image["detail"] = part.detail
        return {"type": "image_url", "image_url": image}
    if isinstance(part, InputFile):
        file = {k: v for k in ("file_id", "file_data", "filename") if (v := getattr(part, k)) is not None}
        if part.file_url is not None:
            fates.drop(path + ".file_url", "the sidecar does not fetch files by URL", *at)
        return {"type": "file", "file": file}
    return {"type": "text", "text": part.text}


def _note_unknown_keys(value: dict[str, Any], kind: str, path: str, fates: Fates, *at: int) -> None:
    known = _KNOWN_KEYS[kind]
    for key in value:
        if key not in known and key != "role":
            fates.drop(f"{path}.{key}", UNKNOWN, *at)
