"""Responses output from the engine's chat answer: the response envelope, its output items, usage.

What shapes a response is `Reply`, read off the request: the tool names to give back as the harness
named them (a namespace's function, a custom tool: responses_tools.py), whether the harness asked for
`reasoning.encrypted_content` (then each reasoning item carries the sidecar's token of its text:
responses_tokens.py), and whether it asked for a compaction (then the one output item is the
`compaction` item holding the engine's summary: responses_compaction.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from agl_sidecar.protocols.responses_compaction import compaction_item
from agl_sidecar.protocols.responses_options import ENCRYPTED_REASONING
from agl_sidecar.protocols.responses_tokens import REASONING, seal
from agl_sidecar.protocols.responses_tools import ToolTable, tool_table


@dataclass(frozen=True, slots=True)
class Reply:
    tools: ToolTable
    encrypted_reasoning: bool = False
    compaction: bool = False

    @classmethod
    def of(cls, body: dict[str, Any], compaction: bool | None = None, tools: ToolTable | None = None) -> Reply:
        """How to answer `body` (`compaction`, `tools`: what translating it found, if it was)."""
        if compaction is None:
            items = body.get("input")
            compaction = isinstance(items, list) and any(
                isinstance(i, dict) and i.get("type") == "compaction_trigger" for i in items
            )
        include = body.get("include") or ()
        return cls(tools if tools is not None else tool_table(body), ENCRYPTED_REASONING in include, compaction)


def response_id(chat_id: str | None) -> str:
    # Derived from the engine's id so the span (gen_ai.response.id) and the harness's id match up.
    suffix = (chat_id or "").removeprefix("chatcmpl-") or uuid.uuid4().hex
    return f"resp_{suffix}"


def usage(engine_usage: dict[str, Any] | None) -> dict[str, Any]:
    engine_usage = engine_usage or {}
    prompt, completion = engine_usage.get("prompt_tokens") or 0, engine_usage.get("completion_tokens") or 0
    cached = (engine_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (engine_usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": engine_usage.get("total_tokens") or prompt + completion,
    }


def status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def envelope(body: dict[str, Any], rid: str, created: float, state: str) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": state,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": body.get("model"),
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": body.get("store", True),
        "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": body.get("truncation", "disabled"),
        "usage": None,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def message_item(item_id: str, text: str, state: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": state, "role": "assistant", "content": [part]}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content}


def seal_reasoning(item: dict[str, Any], reply: Reply) -> dict[str, Any]:
    """`item` with the sidecar's token of its text, when the harness asked for encrypted content."""
    if reply.encrypted_reasoning:
        item["encrypted_content"] = seal(REASONING, item["content"][0]["text"])
    return item


def call_item(call_id: str | None, name: str, arguments: str, state: str, reply: Reply) -> dict[str, Any]:
    """The `function_call` (or `custom_tool_call`) item for the engine's call of tool `name`."""
    call_id = call_id or f"call_{uuid.uuid4().hex[:24]}"
    harness = reply.tools.harness_name(name)
    if harness.custom:
        item = {"type": "custom_tool_call", "id": f"ctc_{call_id}", "call_id": call_id, "name": harness.name,
                "input": custom_input(arguments), "status": state}  # fmt: skip
    else:
        item = {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": harness.name,
                "arguments": arguments, "status": state}  # fmt: skip
    if harness.namespace:
        item["namespace"] = harness.namespace
    return item


def custom_input(arguments: str) -> str:
    """A custom tool's free-form input from the engine's arguments `{"input": ...}` (as written if not)."""
    try:
        decoded = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return arguments
    value = decoded.get("input") if isinstance(decoded, dict) else None
    return value if isinstance(value, str) else arguments


def output_items(message: dict[str, Any], rid: str, state: str, reply: Reply) -> list[dict[str, Any]]:
    """The output items for the engine's chat `message`."""
    content = message.get("content")
    suffix = rid.removeprefix("resp_")
    if reply.compaction:
        return [compaction_item(f"cmp_{suffix}", content or "")]
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        output.append(seal_reasoning(reasoning_item(f"rs_{suffix}", reasoning), reply))
    if content:
        output.append(message_item(f"msg_{suffix}", content, state))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        name, arguments = function.get("name") or "", function.get("arguments") or ""
        output.append(call_item(call.get("id"), name, arguments, "completed", reply))
    return output


def assistant_message(
    content: str | None, reasoning: str | None, tool_calls: list[dict[str, Any]]
) -> dict[str, Any]:
    """The chat message a chained response (`previous_response_id`) continues from."""
    assistant: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        assistant["reasoning"] = assistant["reasoning_content"] = reasoning
    if tool_calls:
        assistant["tool_calls"] = [
            {"id": c.get("id"), "type": "function", "function": c.get("function")} for c in tool_calls
        ]
    return assistant
