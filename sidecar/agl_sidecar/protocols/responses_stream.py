"""The engine's chat.completion.chunk stream as Responses stream events, one chunk at a time.

Events: `response.created`, `response.in_progress`, per output item `response.output_item.added`,
its deltas (`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`) and `.done` events, `response.output_item.done`, then
`response.completed`, `response.incomplete` (max_output_tokens) or `response.failed` (the engine's
stream ended without a finish reason). A custom tool's call is given whole when it ends (its input is
inside the engine's JSON arguments); a compaction request's answer is one `compaction` item, given
when the stream ends. `frame` writes one event: SSE for HTTP, a JSON text message for the WebSocket
transport (routes/responses_ws.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from agl_sidecar.protocols._sse import sse_event
from agl_sidecar.protocols.responses_output import (
    Reply,
    assistant_message,
    call_item,
    custom_input,
    envelope,
    message_item,
    output_items,
    reasoning_item,
    response_id,
    seal_reasoning,
    status as status_of,
    usage,
)

Frame = Callable[[str, dict[str, Any]], bytes]


class Keeper(Protocol):
    """Where a finished response's conversation goes (the adapter's store, for previous_response_id)."""

    def keep(self, body: dict[str, Any], rid: str, assistant: dict[str, Any], summary: str) -> None: ...


class ResponsesStream:
    """chat.completion.chunk dicts in, Responses stream events out (choice 0 only)."""

    def __init__(self, adapter: Keeper, body: dict[str, Any], reply: Reply, frame: Frame = sse_event) -> None:
        self._adapter, self._body, self._reply, self._frame = adapter, body, reply, frame
        self._seq = 0
        self._response: dict[str, Any] | None = None
        self._output: list[dict[str, Any]] = []  # finished items
        self._item: dict[str, Any] | None = None  # the open item
        self._tool_index: int | None = None
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None
        self._text = ""
        self._reasoning = ""
        self._tool_calls: list[dict[str, Any]] = []
        self._ended = False

    def _event(self, name: str, data: dict[str, Any]) -> bytes:
        data = {"type": name, "sequence_number": self._seq, **data}
        self._seq += 1
        return self._frame(name, data)

    def _start(self, chunk: dict[str, Any]) -> list[bytes]:
        created = chunk.get("created") or time.time()
        self._response = envelope(self._body, response_id(chunk.get("id")), created, "in_progress")
        return [
            self._event("response.created", {"response": self._response}),
            self._event("response.in_progress", {"response": self._response}),
        ]

    def _item_id(self, prefix: str) -> str:
        assert self._response is not None
        return f"{prefix}_{self._response['id'][5:]}_{len(self._output)}"

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self._item = item
        events.append(self._event("response.output_item.added", {"output_index": len(self._output), "item": item}))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._content_event("response.content_part.added", {"part": part}))
        return events

    def _content_event(self, name: str, data: dict[str, Any]) -> bytes:
        assert self._item is not None
        where = {"item_id": self._item["id"], "output_index": len(self._output), "content_index": 0}
        return self._event(name, {**where, **data})

    def _close(self) -> list[bytes]:
        item = self._item
        if item is None:
            return []
        events: list[bytes] = []
        kind = item["type"]
        if kind == "message":
            part = item["content"][0]
            events.append(self._content_event("response.output_text.done", {"text": part["text"], "logprobs": []}))
            events.append(self._content_event("response.content_part.done", {"part": part}))
            item["status"] = "completed"
        elif kind == "reasoning":
            text = item["content"][0]["text"]
            events.append(self._content_event("response.reasoning_text.done", {"text": text}))
            seal_reasoning(item, self._reply)
        elif kind == "function_call":
            done = {"item_id": item["id"], "output_index": len(self._output), "name": item["name"],
                    "arguments": item["arguments"]}  # fmt: skip
            events.append(self._event("response.function_call_arguments.done", done))
            item["status"] = "completed"
        elif kind == "custom_tool_call":
            item["input"] = custom_input(self._tool_calls[-1]["function"]["arguments"])
            item["status"] = "completed"
        events.append(self._event("response.output_item.done", {"output_index": len(self._output), "item": item}))
        self._output.append(item)
        self._item = None
        self._tool_index = None
        return events

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        events = [] if self._response is not None else self._start(chunk)
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning:
                self._reasoning += reasoning
                if not self._reply.compaction:
                    events += self._reasoning_delta(reasoning)
            if delta.get("content"):
                self._text += delta["content"]
                if not self._reply.compaction:
                    events += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._tool_call(call)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return events

    def _reasoning_delta(self, text: str) -> list[bytes]:
        events: list[bytes] = []
        if self._item is None or self._item["type"] != "reasoning":
            events += self._open(reasoning_item(self._item_id("rs"), ""))
        assert self._item is not None
        self._item["content"][0]["text"] += text
        events.append(self._content_event("response.reasoning_text.delta", {"delta": text}))
        return events

    def _text_delta(self, text: str) -> list[bytes]:
        events: list[bytes] = []
        if self._item is None or self._item["type"] != "message":
            events += self._open(message_item(self._item_id("msg"), "", "in_progress"))
        assert self._item is not None
        self._item["content"][0]["text"] += text
        events.append(self._content_event("response.output_text.delta", {"delta": text, "logprobs": []}))
        return events

    def _tool_call(self, call: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        index = call.get("index", 0)
        function = call.get("function") or {}
        if not self._tool_calls or index != self._tool_index:
            self._tool_index = index
            named = {"name": function.get("name") or "", "arguments": ""}
            self._tool_calls.append({"id": call.get("id"), "type": "function", "function": named})
            if not self._reply.compaction:
                item = call_item(call.get("id"), function.get("name") or "", "", "in_progress", self._reply)
                events += self._open(item)
                self._tool_index = index
        arguments = function.get("arguments")
        if arguments:
            self._tool_calls[-1]["function"]["arguments"] += arguments
            if self._item is not None and self._item["type"] == "function_call":
                self._item["arguments"] += arguments
                delta = {"item_id": self._item["id"], "output_index": len(self._output), "delta": arguments}
                events.append(self._event("response.function_call_arguments.delta", delta))
        return events

    def _end(self) -> list[bytes]:
        if self._ended:
            return []
        self._ended = True
        events = self._close()
        assert self._response is not None
        state, incomplete = status_of(self._finish_reason)
        response = {**self._response, "status": state, "incomplete_details": incomplete}
        if self._finish_reason is None:  # the engine's stream ended without a finish reason
            state = response["status"] = "failed"
            response["error"] = {"code": "server_error", "message": "the engine's stream ended before it finished"}
        if self._reply.compaction:
            message = {"content": self._text}
            for n, item in enumerate(output_items(message, response["id"], state, self._reply)):
                events.append(self._event("response.output_item.added", {"output_index": n, "item": item}))
                events.append(self._event("response.output_item.done", {"output_index": n, "item": item}))
                self._output.append(item)
        response["output"] = self._output
        response["usage"] = usage(self._usage)
        assistant = assistant_message(self._text or None, self._reasoning or None, self._tool_calls)
        self._adapter.keep(self._body, response["id"], assistant, self._text)
        name = {"completed": "response.completed", "failed": "response.failed"}.get(state, "response.incomplete")
        return [*events, self._event(name, {"response": response})]

    def finish(self) -> list[bytes]:
        """The open item's end and the response's, when the engine's stream has ended: its last
        write. A client hangs up as soon as it has the response's end (Codex, after its compaction
        request): the call is recorded delivered only if nothing is awaited after that write."""
        events = [] if self._response is not None else self._start({})
        return events + self._end()
