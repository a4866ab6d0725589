"""Anthropic Messages (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over a chat engine.

Requests are checked against msgspec Structs (anthropic_request.py: a body the API refuses gets its
400, naming the field, in Anthropic's format), then translated to chat completions by litellm (content blocks, images, tool use
and results, thinking, tool_choice, stop sequences), with the fix-up in `_to_chat`.

Responses are built here, from the engine's chat response, because litellm's way back is wrong or
slow for a vLLM engine (bench/protocols_overhead.py measures it):
- translate_openai_response_to_anthropic needs a litellm ModelResponse (about 0.6 ms a call with
  a tool call, 40x building the message directly); it merges every choice into one message; it
  drops vLLM's `stop_reason` (the matched stop string), so stop_sequence is always null; it reads
  reasoning only from `reasoning_content` (vLLM 0.32 sends `reasoning`) and then sets a null
  thinking signature, which the Anthropic types reject; it keeps an empty text block beside tool
  calls (the API rejects empty text blocks when the harness sends the turn back); and it raises on
  tool arguments that are not JSON, which RL-trained models do produce.
- its AnthropicStreamWrapper pulls ModelResponseStream objects from an iterator, so it cannot be
  fed one chunk at a time from the sidecar's push loop (and costs about 0.5 ms a chunk).
"""

from __future__ import annotations

import json
from typing import Any

from agl import semconv

from agl_sidecar.protocols._litellm import anthropic_adapter
from agl_sidecar.protocols._sse import sse_event
from agl_sidecar.protocols.anthropic_request import CountTokensRequest, MessagesRequest, check_messages
from agl_sidecar.protocols.base import ProtocolError, Translation

# --- The request: checked as the API checks it (anthropic_request.py) ---------------------------


def _validate(body: Any, request_type: type[CountTokensRequest]) -> None:
    if not isinstance(body, dict):
        raise ProtocolError(400, "request body must be a JSON object")
    check_messages(body, request_type)


def _to_chat(body: dict[str, Any]) -> dict[str, Any]:
    try:
        # litellm pops keys from the request it is given: hand it a copy.
        chat, _ = anthropic_adapter().translate_anthropic_to_openai(
            dict(body), custom_llm_provider="hosted_vllm"
        )
    except Exception as exc:  # noqa: BLE001 - litellm raises ValueError, TypeError, pydantic errors ...
        raise ProtocolError(400, f"cannot translate the request: {exc}") from None
    return _for_engine(chat, body.get("thinking"))


# Anthropic-only request fields litellm passes through untranslated; an OpenAI-compatible engine
# has no use for them (vLLM logs every ignored field).
_ANTHROPIC_ONLY = (
    "thinking", "context_management", "container", "mcp_servers", "service_tier", "betas", "cache_control",
    "output_config", "speed", "user_profile_id", "workspace_id", "diagnostics", "inference_geo",
)  # fmt: skip


def _for_engine(chat: dict[str, Any], thinking: Any) -> dict[str, Any]:
    """Fix-ups of litellm's chat request for an open model on vLLM (`thinking`: the request's)."""
    for key in _ANTHROPIC_ONLY:
        chat.pop(key, None)
    # litellm turns `thinking` into `reasoning_effort` (gpt-oss reads it); open reasoning models
    # such as Qwen3 switch on the chat-template variable `enable_thinking` instead, which templates
    # without it ignore.
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled", "adaptive", "between_tools"):
        kwargs = chat.setdefault("chat_template_kwargs", {})
        kwargs.setdefault("enable_thinking", thinking["type"] != "disabled")  # adaptive: the model may think
    if "tools" in chat:
        chat["tools"] = _without_cache_control(chat["tools"])
    for message in chat["messages"]:
        # litellm adds `thinking_blocks` (Anthropic's signed blocks, None when absent) beside
        # `reasoning_content`, which is what chat templates read.
        message.pop("thinking_blocks", None)
        if "content" in message:
            message["content"] = _without_cache_control(message["content"])
    return chat


def _without_cache_control(items: Any) -> Any:
    """`items` without Anthropic's prompt-caching marks (copies, never the harness's own dicts):
    vLLM caches prefixes by itself, and an unknown key in a content part or tool is at best ignored."""
    if not isinstance(items, list) or not any(isinstance(i, dict) and "cache_control" in i for i in items):
        return items
    return [{k: v for k, v in i.items() if k != "cache_control"} if isinstance(i, dict) else i for i in items]


# --- Anthropic's error format ----------------------------------------------------------------

_ERROR_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
_ERROR_TYPES = frozenset(_ERROR_TYPE_BY_STATUS.values())


def anthropic_error(status: int, message: str, error_type: str = "") -> dict[str, Any]:
    """`{"type": "error", "error": {...}}`, typed by status when `error_type` is not Anthropic's."""
    if error_type not in _ERROR_TYPES:
        error_type = _ERROR_TYPE_BY_STATUS.get(
            status, "api_error" if status >= 500 else "invalid_request_error"
        )
    return {"type": "error", "error": {"type": error_type, "message": message}}


# --- Responses -------------------------------------------------------------------------------

_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
}


def _stop_reason(choice: dict[str, Any]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat choice; vLLM's `stop_reason` names the stop string."""
    finish = choice.get("finish_reason") or "stop"
    matched = choice.get("stop_reason")
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    if finish in ("content_filter", "refusal"):
        return "refusal", None
    return _STOP_REASONS.get(finish, "end_turn"), None


def _usage(chat: dict[str, Any]) -> dict[str, int]:
    usage = chat.get("usage") or {}
    return {
        "input_tokens": usage.get("prompt_tokens") or 0,
        "output_tokens": usage.get("completion_tokens") or 0,
    }


def _tool_input(arguments: str | None) -> Any:
    """The tool call's arguments as the object Anthropic's `input` must be; arguments that are not a
    JSON object are kept whole under `_raw_arguments` (the harness's tool then reports the error)."""
    if not arguments or not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"_raw_arguments": arguments}
    return value if isinstance(value, dict) else {"_raw_arguments": arguments}


def _message_from_chat(chat: dict[str, Any], model: str) -> dict[str, Any]:
    choices = chat.get("choices") or []
    choice = choices[0] if choices else {}
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = _reasoning(message)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = message.get("content")
    tool_calls = message.get("tool_calls") or []
    if text or (text is not None and not tool_calls and not content):
        content.append({"type": "text", "text": text})
    for call in tool_calls:
        function = call.get("function") or {}
        name = function.get("name") or ""
        block = {
            "type": "tool_use",
            "id": call.get("id") or "",
            "name": name,
            "input": _tool_input(function.get("arguments")),
        }
        content.append(block)
    stop_reason, stop_sequence = _stop_reason(choice) if choice else ("end_turn", None)
    return {
        "id": chat.get("id") or "msg_agl",
        "type": "message",
        "role": "assistant",
        "model": chat.get("model") or model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(chat),
    }


def _reasoning(message: dict[str, Any]) -> str | None:
    # vLLM 0.32 names it `reasoning`; older servers and litellm `reasoning_content`.
    return message.get("reasoning") or message.get("reasoning_content")


class _MessagesStream:
    """chat.completion.chunk dicts in, Anthropic message stream events out (choice 0 only)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self._model = body.get("model", "")
        self._started = False
        self._block_index = -1
        self._block_kind: str | None = None  # "text" | "thinking" | "tool_use" while a block is open
        self._tool_index: int | None = None
        self._stop: tuple[str, str | None] | None = None
        self._usage: dict[str, int] | None = None
        self._ended = False

    def _start(self, chunk: dict[str, Any]) -> list[bytes]:
        self._started = True
        prompt_ids = chunk.get("prompt_token_ids")
        message = {
            "id": chunk.get("id") or "msg_agl",
            "type": "message",
            "role": "assistant",
            "model": chunk.get("model") or self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(prompt_ids) if prompt_ids else 0, "output_tokens": 0},
        }
        return [sse_event("message_start", {"type": "message_start", "message": message})]

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self._block_index += 1
        self._block_kind = kind
        start = {"type": "content_block_start", "index": self._block_index, "content_block": block}
        return [*events, sse_event("content_block_start", start)]

    def _close(self) -> list[bytes]:
        if self._block_kind is None:
            return []
        self._block_kind = None
        self._tool_index = None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": self._block_index})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        event = {"type": "content_block_delta", "index": self._block_index, "delta": delta}
        return sse_event("content_block_delta", event)

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        events = [] if self._started else self._start(chunk)
        if chunk.get("usage"):
            self._usage = _usage(chunk)
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = _reasoning(delta)
            if reasoning:
                if self._block_kind != "thinking":
                    events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                events.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
            if delta.get("content"):
                if self._block_kind != "text":
                    events += self._open("text", {"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                events += self._tool_call(call)
            if choice.get("finish_reason"):
                self._stop = _stop_reason(choice)
                events += self._close()
        if self._stop is not None and self._usage is not None:
            events += self._end()
        return events

    def _tool_call(self, call: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        function = call.get("function") or {}
        index = call.get("index", 0)
        if self._block_kind != "tool_use" or index != self._tool_index:
            block = {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{index}",
                "name": function.get("name") or "",
                "input": {},
            }
            events += self._open("tool_use", block)
            self._tool_index = index
        if function.get("arguments"):
            events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return events

    def _end(self) -> list[bytes]:
        if self._ended:
            return []
        self._ended = True
        stop_reason, stop_sequence = self._stop or ("end_turn", None)
        usage = self._usage or {"input_tokens": 0, "output_tokens": 0}
        message_delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": usage,
        }
        return [
            *self._close(),
            sse_event("message_delta", message_delta),
            sse_event("message_stop", {"type": "message_stop"}),
        ]

    def finish(self) -> list[bytes]:
        events = [] if self._started else self._start({})
        return events + self._end()


class MessagesAdapter:
    """POST /v1/messages."""

    api = semconv.API_ANTHROPIC_MESSAGES
    path = "/messages"
    tokenize_only = False

    def prepare(self) -> None:
        anthropic_adapter()

    def to_chat_request(self, body: dict[str, Any]) -> Translation:
        _validate(body, MessagesRequest)
        chat = _to_chat(body)
        if body.get("stream"):
            chat["stream"] = True
            # message_delta carries the output token count: ask the engine for the usage chunk.
            chat["stream_options"] = {"include_usage": True}
        else:
            chat.pop("stream", None)
        return Translation(chat)

    def from_chat_response(self, chat: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        return _message_from_chat(chat, body.get("model", ""))

    def stream_translator(self, body: dict[str, Any]) -> _MessagesStream:
        return _MessagesStream(body)

    def error_body(self, status: int, message: str, error_type: str, param: str | None = None) -> dict[str, Any]:
        return anthropic_error(status, message, error_type)


class CountTokensAdapter(MessagesAdapter):
    """POST /v1/messages/count_tokens: the engine's /tokenize counts the chat-templated prompt."""

    path = "/messages/count_tokens"
    tokenize_only = True

    def to_chat_request(self, body: dict[str, Any]) -> Translation:
        _validate(body, CountTokensRequest)
        chat = _to_chat(body)
        request = {"model": chat["model"], "messages": chat["messages"], "add_generation_prompt": True}
        if chat.get("tools"):
            request["tools"] = chat["tools"]
        return Translation(request)

    def from_chat_response(self, chat: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        count = chat.get("count")
        if not isinstance(count, int):
            tokens = chat.get("tokens")
            if not isinstance(tokens, list):
                raise ProtocolError(
                    502, "the engine's /tokenize answer has neither `count` nor `tokens`", "api_error"
                )
            count = len(tokens)
        return {"input_tokens": count}

    def stream_translator(self, body: dict[str, Any]) -> _MessagesStream:
        raise ProtocolError(400, "count_tokens does not stream")


MESSAGES = MessagesAdapter()
COUNT_TOKENS = CountTokensAdapter()
