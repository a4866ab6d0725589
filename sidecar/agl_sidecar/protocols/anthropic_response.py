"""Anthropic Messages responses and streams built from the engine's chat responses and chunks.

Built here, not by litellm, because litellm's way back is wrong or slow for a vLLM engine
(bench/protocols_overhead.py measures it): translate_openai_response_to_anthropic needs a litellm
ModelResponse (about 0.6 ms a call with a tool call, 40x building the message directly); it merges
every choice into one message; it drops vLLM's `stop_reason` (the matched stop string), so
stop_sequence is always null; it reads reasoning only from `reasoning_content` (vLLM 0.32 sends
`reasoning`) and then sets a null thinking signature, which the Anthropic types reject; it keeps an
empty text block beside tool calls (the API rejects empty text blocks when the harness sends the
turn back); and it raises on tool arguments that are not JSON, which RL-trained models do produce.
Its AnthropicStreamWrapper pulls ModelResponseStream objects from an iterator, so it cannot be fed one
chunk at a time from the sidecar's push loop (and costs about 0.5 ms a chunk).

What the request side decided travels in the request body under NOTES (Translation.respond_to):
the compaction block the response opens with, and the context edits applied.
"""

from __future__ import annotations

import json
from typing import Any

from agl_sidecar.protocols import anthropic_thinking as thinking
from agl_sidecar.protocols._sse import sse_event
from agl_sidecar.protocols.anthropic_compaction import compaction_block

NOTES = "_agl"  # key of the adapter's notes in Translation.respond_to (never an Anthropic field)

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
        error_type = _ERROR_TYPE_BY_STATUS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}


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
    return {"input_tokens": usage.get("prompt_tokens") or 0, "output_tokens": usage.get("completion_tokens") or 0}


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


def _reasoning(message: dict[str, Any]) -> str | None:
    # vLLM 0.32 names it `reasoning`; older servers and litellm `reasoning_content`.
    return message.get("reasoning") or message.get("reasoning_content")


def _notes(body: dict[str, Any]) -> dict[str, Any]:
    notes = body.get(NOTES)
    return notes if isinstance(notes, dict) else {}


def _context_management(body: dict[str, Any]) -> dict[str, Any] | None:
    """The response's `context_management` (the edits applied), when the request asked for edits."""
    if "context_management" not in body:
        return None
    return {"applied_edits": list(_notes(body).get("applied_edits", ()))}


def message_from_chat(chat: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """The Messages API response for the engine's chat response `chat` to the request `body`."""
    choices = chat.get("choices") or []
    choice = choices[0] if choices else {}
    message = choice.get("message") or {}
    notes = _notes(body)
    content: list[dict[str, Any]] = []
    if "compaction" in notes:
        content.append(compaction_block(notes["compaction"]))
    reasoning = _reasoning(message)
    if reasoning:
        content.append(thinking.block(reasoning, thinking.omitted(body.get("thinking"))))
    text = message.get("content")
    tool_calls = message.get("tool_calls") or []
    if text or (text is not None and not tool_calls and not content):
        content.append({"type": "text", "text": text})
    for call in tool_calls:
        function = call.get("function") or {}
        block = {"type": "tool_use", "id": call.get("id") or "", "name": function.get("name") or ""}
        content.append({**block, "input": _tool_input(function.get("arguments"))})
    stop_reason, stop_sequence = _stop_reason(choice) if choice else ("end_turn", None)
    out = {
        "id": chat.get("id") or "msg_agl",
        "type": "message",
        "role": "assistant",
        "model": chat.get("model") or body.get("model", ""),
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(chat),
    }
    managed = _context_management(body)
    if managed is not None:
        out["context_management"] = managed
    return out


def paused_after_compaction(body: dict[str, Any]) -> dict[str, Any]:
    """The whole response when compaction pauses the turn: the compaction block alone."""
    out = message_from_chat({"id": "msg_agl_compaction", "choices": []}, body)
    return {**out, "stop_reason": "compaction"}


class MessagesStream:
    """chat.completion.chunk dicts in, Anthropic message stream events out (choice 0 only)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self._body = body
        self._model = body.get("model", "")
        self._hide_thinking = thinking.omitted(body.get("thinking"))
        self._started = False
        self._block_index = -1
        self._block_kind: str | None = None  # "text" | "thinking" | "tool_use" while a block is open
        self._reasoning: list[str] = []  # the open thinking block's text, signed when it closes
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
        events = [sse_event("message_start", {"type": "message_start", "message": message})]
        notes = _notes(self._body)
        if "compaction" in notes:
            events += self._open("compaction", {"type": "compaction", "content": None})
            events.append(self._delta({"type": "compaction_delta", "content": notes["compaction"]}))
            events += self._close()
        return events

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self._block_index += 1
        self._block_kind = kind
        start = {"type": "content_block_start", "index": self._block_index, "content_block": block}
        return [*events, sse_event("content_block_start", start)]

    def _close(self) -> list[bytes]:
        if self._block_kind is None:
            return []
        events = []
        if self._block_kind == "thinking":  # the signature carries the whole text: sent last, as Anthropic does
            signature = thinking.sign("".join(self._reasoning))
            events.append(self._delta({"type": "signature_delta", "signature": signature}))
            self._reasoning = []
        self._block_kind = None
        self._tool_index = None
        return [*events, sse_event("content_block_stop", {"type": "content_block_stop", "index": self._block_index})]

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
                self._reasoning.append(reasoning)
                if not self._hide_thinking:
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
            block = {"type": "tool_use", "id": call.get("id") or f"toolu_{index}", "name": function.get("name") or "", "input": {}}
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
        message_delta: dict[str, Any] = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": usage,
        }
        managed = _context_management(self._body)
        if managed is not None:
            message_delta["context_management"] = managed
        return [*self._close(), sse_event("message_delta", message_delta), sse_event("message_stop", {"type": "message_stop"})]

    def finish(self, stop_reason: str | None = None) -> list[bytes]:
        """The events that close the stream (`stop_reason`: when no chunk gave one)."""
        events = [] if self._started else self._start({})
        if stop_reason is not None and self._stop is None:
            self._stop = (stop_reason, None)
        return events + self._end()


def paused_stream(body: dict[str, Any]) -> bytes:
    """The stream of a response that compaction paused: the compaction block, stop reason `compaction`."""
    return b"".join(MessagesStream(body).finish("compaction"))
