"""Anthropic Messages (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over a chat engine.

A request goes through, in order:
- anthropic_request.py: checked as the API checks it (a known field's wrong value is its 400, naming
  the field); what the sidecar does not know is passed on or dropped, and written down;
- anthropic_compaction.py: a compaction block the harness sent back stands for everything before it;
- anthropic_context.py: the context edits it asks for (thinking and tool-use clearing), counting
  tokens with the engine's tokenizer where an edit's trigger or report needs it (a Step);
- anthropic_compaction.py again: server-side compaction, when asked for and triggered, asks the policy
  for the summary (a Step: a call of its own) and answers from the compacted context; Claude Code's
  own compaction calls are recognised and declared;
- litellm translates the messages (content blocks, images, documents, tool use and results, tool
  choice, stop sequences), and `_for_engine` keeps what an OpenAI-compatible engine takes: `system`
  entries inside `messages` stay system messages in place, thinking becomes the assistant message's
  `reasoning` / `reasoning_content`, the template's `enable_thinking` follows `thinking`.
Responses and streams are built in anthropic_response.py.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import msgspec
from agl import semconv

from agl_sidecar.protocols import anthropic_compaction as compaction
from agl_sidecar.protocols import anthropic_context as context
from agl_sidecar.protocols._litellm import anthropic_adapter
from agl_sidecar.protocols.anthropic_request import CountTokensRequest, MessagesRequest, Read, read_request
from agl_sidecar.protocols.anthropic_response import (
    NOTES,
    MessagesStream,
    anthropic_error,
    message_from_chat,
    paused_after_compaction,
    paused_stream,
)
from agl_sidecar.protocols.base import STEP_COUNT, STEP_SUMMARIZE, Declared, ProtocolError, Step, Translation

__all__ = ["COUNT_TOKENS", "MESSAGES", "anthropic_error"]

# The keys of litellm's chat request an OpenAI-compatible engine takes (litellm adds its own:
# `prompt_cache_key`, `context_management`, ...; vLLM logs every field it ignores).
ENGINE_KEYS = frozenset({
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "max_tokens", "temperature", "top_p",
    "top_k", "stop", "user", "reasoning_effort", "response_format", "stream",
})  # fmt: skip
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
SEEN_SUMMARIES = compaction.SeenSummaries()

Flow = Generator[tuple[str, dict[str, Any]], Any, Translation]


def _read(body: Any, request_type: type[CountTokensRequest]) -> Read:
    if not isinstance(body, dict):
        raise ProtocolError(400, "request body must be a JSON object")
    return read_request(body, request_type)


def _drive(flow: Flow, result: Any = None) -> Translation:
    """The flow run up to its next Step (the core does it and resumes here) or its Translation."""
    try:
        kind, chat = flow.send(result)
    except StopIteration as done:
        return done.value
    return Translation(chat, step=Step(kind, chat, resume=lambda answer: _drive(flow, answer)))


Edited = Generator[tuple[str, dict[str, Any]], Any, tuple[list[dict[str, Any]], list[str]]]


def _edited(read: Read, body: dict[str, Any], notes: dict[str, Any]) -> Edited:
    """The request's messages after the context edits it asks for, and the edits that changed them;
    what each edit cleared goes into `notes["applied_edits"]`."""
    edits = context.plan(body, read.fates)
    messages = compaction.after_last_compaction(read.body["messages"])
    applied, changed = context.Applied(), []
    counted: int | None = None  # the prompt tokens of `messages`, once counted

    if edits.clear_thinking is not None or edits.default_thinking:
        cleared, turns = context.clear_thinking(messages, context.thinking_turns_kept(edits.clear_thinking))
        if turns and edits.clear_thinking is not None:  # asked for: its report counts what it cleared
            counted = yield STEP_COUNT, _count_request(read, messages)
            after = yield STEP_COUNT, _count_request(read, cleared)
            applied.add(context.CLEAR_THINKING, "thinking_turns", turns, counted - after)
            counted = after
        if turns:
            messages = cleared
            changed.append(context.CLEAR_THINKING)

    edit = edits.clear_tool_uses
    if edit is not None:
        if isinstance(edit.trigger, context.ToolUses):
            triggered = context.count_tool_uses(messages) > edit.trigger.value
        else:
            if counted is None:
                counted = yield STEP_COUNT, _count_request(read, messages)
            triggered = counted > (edit.trigger.value if edit.trigger else 100_000)
        cleared, uses = context.clear_tool_uses(messages, edit) if triggered else (messages, 0)
        if uses:
            if counted is None:
                counted = yield STEP_COUNT, _count_request(read, messages)
            after = yield STEP_COUNT, _count_request(read, cleared)
            if edit.clear_at_least is None or counted - after >= edit.clear_at_least.value:
                applied.add(context.CLEAR_TOOL_USES, "tool_uses", uses, counted - after)
                messages, counted = cleared, after
                changed.append(context.CLEAR_TOOL_USES)

    if edits.compact is not None:
        if counted is None:
            counted = yield STEP_COUNT, _count_request(read, messages)
        if counted > (edits.compact.trigger.value if edits.compact.trigger else 150_000):
            request = compaction.summary_request(_chat(read, messages), edits.compact.instructions)
            summary = compaction.summary_of((yield STEP_SUMMARIZE, request))
            notes["compaction"] = summary
            notes["pause"] = edits.compact.pause_after_compaction
            if summary is not None:  # None: the compaction failed, a no-op (the API's null content)
                messages = [compaction.summary_turn(summary)]
                changed.append(context.COMPACT)
    if applied.edits:
        notes["applied_edits"] = applied.edits
    return messages, changed


def _messages_flow(body: dict[str, Any], read: Read) -> Flow:
    notes: dict[str, Any] = {}
    messages, changed = yield from _edited(read, body, notes)
    respond_to = {**body, NOTES: notes}  # always: a harness's own "_agl" key is no note of ours
    fates = read.fates
    if notes.get("pause"):
        answer = paused_stream(respond_to) if body.get("stream") else _json(paused_after_compaction(respond_to))
        content_type = "text/event-stream; charset=utf-8" if body.get("stream") else "application/json"
        return Translation({}, fates.dropped(), fates.passed(), reply=(answer, content_type), respond_to=respond_to)
    original = read.body["messages"]
    continuation = compaction.claude_code_continuation(original)
    declared = (
        context.COMPACT in changed
        or compaction.is_claude_code_summary_call(original)
        or (continuation is not None and SEEN_SUMMARIES.first_time(continuation))
    )
    chat = _chat(read, messages)
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # message_delta carries the output token count
    else:
        chat.pop("stream", None)
    return Translation(
        chat, fates.dropped(), fates.passed(), declared=Declared(compaction=True) if declared else None,
        context_edits=tuple(changed), respond_to=respond_to,
    )


def _count_flow(body: dict[str, Any], read: Read) -> Flow:
    messages, _ = yield from _edited(read, {**body, "context_management": _without_compaction(body)}, {})
    return Translation(_count_request(read, messages), read.fates.dropped(), read.fates.passed())


def _without_compaction(body: dict[str, Any]) -> Any:
    """count_tokens counts the prompt as edited, but never asks the policy for a summary."""
    config = body.get("context_management")
    if not isinstance(config, dict) or not isinstance(config.get("edits"), list):
        return config
    edits = [e for e in config["edits"] if not (isinstance(e, dict) and e.get("type") == context.COMPACT)]
    return {**config, "edits": edits}


def _json(value: dict[str, Any]) -> bytes:
    return msgspec.json.encode(value)


# --- the chat request ------------------------------------------------------------------------


def _chat(read: Read, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine's chat request for `messages` (prepared Anthropic messages) and the request's options."""
    roles = [m["role"] for m in messages if m["role"] not in ("user", "assistant")]
    # Tools are translated here: litellm deep-copies every schema (half its time on Claude Code's 12)
    # and cuts names to OpenAI's 64 characters, which an open model's engine does not need.
    source = {k: v for k, v in read.body.items() if k not in ("context_management", "tools")}
    # Entries of another role travel through litellm as system entries (which it keeps in place)
    source["messages"] = [m if m["role"] in ("user", "assistant") else {**m, "role": "system"} for m in messages]
    try:
        # litellm pops keys from the request it is given: hand it a copy.
        chat, _ = anthropic_adapter().translate_anthropic_to_openai(
            source, custom_llm_provider="hosted_vllm", preserve_midturn_system=True
        )
    except Exception as exc:  # noqa: BLE001 - litellm raises ValueError, TypeError, pydantic errors ...
        raise ProtocolError(400, f"cannot translate the request: {exc}") from None
    inner = chat["messages"][1:] if read.body.get("system") else chat["messages"]
    entries = iter(roles)
    for message in inner:
        if message["role"] == "system":
            message["role"] = next(entries, "system")
    tools = [_function(tool) for tool in read.body.get("tools") or ()]
    if tools:
        chat["tools"] = tools
    chat = _for_engine(chat, read.body.get("thinking"))
    chat.update(read.engine_parameters)
    if messages and messages[-1]["role"] == "assistant":  # a prefill: the answer continues it
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    return chat


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic client tool as an OpenAI function tool (its schema is shared, not copied)."""
    function = {"name": tool["name"]}
    if "description" in tool:
        function["description"] = tool["description"]
    function["parameters"] = tool["input_schema"]
    return {"type": "function", "function": function}


def _count_request(read: Read, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine's POST /tokenize request for the prompt the chat request of `messages` would have
    (system, tools and the template's options included), so its count is that prompt's."""
    chat = _chat(read, messages)
    request = {"model": chat["model"], "messages": chat["messages"]}
    request["add_generation_prompt"] = chat.get("add_generation_prompt", True)
    for key in ("continue_final_message", "tools", "chat_template_kwargs"):
        if chat.get(key):
            request[key] = chat[key]
    return request


def _for_engine(chat: dict[str, Any], thinking: Any) -> dict[str, Any]:
    """litellm's chat request reduced to what an open model on vLLM takes (`thinking`: the request's)."""
    chat = {k: v for k, v in chat.items() if k in ENGINE_KEYS}
    # litellm turns `thinking` into `reasoning_effort` (gpt-oss reads it); open reasoning models
    # such as Qwen3 switch on the chat-template variable `enable_thinking` instead, which templates
    # without it ignore.
    if isinstance(thinking, dict) and thinking.get("type") in THINKING_TYPES:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}  # adaptive: may think
    for message in chat["messages"]:
        # litellm adds `thinking_blocks` (Anthropic's signed blocks) beside `reasoning_content`; vLLM
        # reads `reasoning` from a message, chat templates `reasoning_content`: both carry the text.
        message.pop("thinking_blocks", None)
        if message.get("reasoning_content"):
            message["reasoning"] = message["reasoning_content"]
        if "content" in message:
            message["content"] = _without_cache_control(message["content"])
    return chat


def _without_cache_control(items: Any) -> Any:
    """`items` without Anthropic's prompt-caching marks (copies, never the harness's own dicts):
    vLLM caches prefixes by itself, and an unknown key in a content part or tool is at best ignored."""
    if not isinstance(items, list) or not any(isinstance(i, dict) and "cache_control" in i for i in items):
        return items
    return [{k: v for k, v in i.items() if k != "cache_control"} if isinstance(i, dict) else i for i in items]


# --- the adapters ----------------------------------------------------------------------------


class MessagesAdapter:
    """POST /v1/messages."""

    api = semconv.API_ANTHROPIC_MESSAGES
    path = "/messages"
    tokenize_only = False

    def prepare(self) -> None:
        anthropic_adapter()

    def to_chat_request(self, body: dict[str, Any]) -> Translation:
        read = _read(body, MessagesRequest)
        return _drive(_messages_flow(body, read))

    def from_chat_response(self, chat: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        return message_from_chat(chat, body)

    def stream_translator(self, body: dict[str, Any]) -> MessagesStream:
        return MessagesStream(body)

    def error_body(self, status: int, message: str, error_type: str, param: str | None = None) -> dict[str, Any]:
        return anthropic_error(status, message, error_type)


class CountTokensAdapter(MessagesAdapter):
    """POST /v1/messages/count_tokens: the engine's /tokenize counts the prompt the same request
    would have as a generation call (its chat template, system, tools and edits included)."""

    path = "/messages/count_tokens"
    tokenize_only = True

    def to_chat_request(self, body: dict[str, Any]) -> Translation:
        read = _read(body, CountTokensRequest)
        return _drive(_count_flow(body, read))

    def from_chat_response(self, chat: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        count = chat.get("count")
        if not isinstance(count, int):
            tokens = chat.get("tokens")
            if not isinstance(tokens, list):
                raise ProtocolError(502, "the engine's /tokenize answer has neither `count` nor `tokens`", "api_error")
            count = len(tokens)
        return {"input_tokens": count}

    def stream_translator(self, body: dict[str, Any]) -> MessagesStream:
        raise ProtocolError(400, "count_tokens does not stream")


MESSAGES = MessagesAdapter()
COUNT_TOKENS = CountTokensAdapter()
