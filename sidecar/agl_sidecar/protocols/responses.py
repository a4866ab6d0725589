"""The OpenAI Responses API (`POST /v1/responses`) over a chat engine.

Requests are checked against msgspec Structs (responses_request.py: what the API refuses gets its
400 with the field in `param`), then their input items, tools and options are
translated to chat completions by litellm's Responses bridge (fix-ups in `_to_chat`). Responses
and streams are built here: litellm's transform_chat_completion_response_to_responses_api_response
costs about 0.7 ms a call and sets `usage.*_tokens_details` to null, which the openai SDK's
`Response` type rejects; its streaming iterator pulls litellm stream objects and cannot be fed
chunk by chunk.

`previous_response_id`: the sidecar keeps each stored response's conversation (chat messages, the
response's own output included) in `ConversationStore`, bounded by count and by bytes (least
recently used first out), so a harness that chains responses works against a stateless engine.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Any

import msgspec
from agl import semconv

from agl_sidecar.spans.lru import BytesLRU
from agl_sidecar.protocols._litellm import responses_config
from agl_sidecar.protocols._sse import sse_event
from agl_sidecar.protocols.base import ProtocolError, Translation
from agl_sidecar.protocols.responses_request import check_responses

# Chat request keys the engine understands; litellm's bridge adds its own (custom_llm_provider,
# extra_headers, metadata, reasoning_summary, ...), which must not reach vLLM.
_ENGINE_KEYS = (
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p",
    "max_tokens", "user", "response_format", "reasoning_effort", "stream", "stream_options",
)  # fmt: skip


class ConversationStore:
    """Conversations by response id, encoded as JSON bytes, evicted LRU past either bound."""

    def __init__(self, max_entries: int = 4096, max_bytes: int = 256 * 1024 * 1024) -> None:
        self._lru: BytesLRU[str, bytes] = BytesLRU(max_bytes, _data_size, max_entries)
        self._encode = msgspec.json.Encoder().encode
        self._decode = msgspec.json.Decoder(list[dict[str, Any]]).decode

    @property
    def bytes(self) -> int:
        return self._lru.bytes

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self._lru.put(response_id, self._encode(messages))

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        data = self._lru.get(response_id)
        return None if data is None else self._decode(data)

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._lru


def _data_size(response_id: str, data: bytes) -> int:
    return len(data)


def openai_error(status: int, message: str, error_type: str = "", param: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape: {"error": {"message", "type", "param", "code"}}."""
    if not error_type:
        error_type = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": None}}


def _response_id(chat_id: str | None) -> str:
    # Derived from the engine's id so the span (gen_ai.response.id) and the harness's id match up.
    suffix = (chat_id or "").removeprefix("chatcmpl-") or uuid.uuid4().hex
    return f"resp_{suffix}"


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": usage.get("total_tokens") or prompt + completion,
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _function_call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    function = call.get("function") or {}
    call_id = call.get("id") or f"call_{uuid.uuid4().hex[:24]}"
    return {
        "type": "function_call",
        "id": f"fc_{call_id}",
        "call_id": call_id,
        "name": function.get("name") or "",
        "arguments": function.get("arguments") or "",
        "status": status,
    }


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


class ResponsesAdapter:
    """POST /v1/responses."""

    api = semconv.API_RESPONSES
    path = "/responses"
    tokenize_only = False

    def prepare(self) -> None:
        responses_config()

    def __init__(self, store: ConversationStore | None = None) -> None:
        self.store = store or ConversationStore()
        # What to_chat_request built for a body, so the response can store the conversation
        # without translating it again; keyed by id(body), checked by identity, bounded.
        self._pending: OrderedDict[int, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self._pending_limit = 4096

    # --- request ---------------------------------------------------------------------------
    def to_chat_request(self, body: dict[str, Any]) -> Translation:
        if not isinstance(body, dict):
            raise ProtocolError(400, "request body must be a JSON object")
        check_responses(body)
        history: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            stored = self.store.get(previous)
            if stored is None:
                raise ProtocolError(
                    404,
                    f"Previous response with id '{previous}' not found (the sidecar keeps a bounded number).",
                )
            history = stored
        chat = self._to_chat(body)
        conversation = history + chat["messages"]
        instructions = body.get("instructions")
        # Instructions are not carried over from a previous response (as in OpenAI's API).
        chat["messages"] = (
            [{"role": "system", "content": instructions}] if instructions else []
        ) + conversation
        self._remember(body, conversation)
        return Translation(chat)

    @staticmethod
    def _to_chat(body: dict[str, Any]) -> dict[str, Any]:
        params = {k: v for k, v in body.items() if k not in ("model", "input", "instructions", "stream")}
        stream = bool(body.get("stream"))
        try:
            translated = responses_config().transform_responses_api_request_to_chat_completion_request(
                model=body["model"], input=body["input"], responses_api_request=params,
                custom_llm_provider="hosted_vllm", stream=stream or None,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - litellm raises BadRequestError, ValueError, KeyError ...
            raise ProtocolError(400, f"cannot translate the request: {exc}") from None
        chat = {k: translated[k] for k in _ENGINE_KEYS if translated.get(k) is not None}
        for message in chat["messages"]:
            # Fix-up: litellm keeps the `developer` role, which open models' chat templates
            # (ChatML, Qwen, Llama) do not know; it means what `system` means to them.
            if message.get("role") == "developer":
                message["role"] = "system"
        return chat

    def _remember(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if body.get("store") is False:
            return
        self._pending[id(body)] = (body, conversation)
        while len(self._pending) > self._pending_limit:
            self._pending.popitem(last=False)

    def _store(self, body: dict[str, Any], response_id: str, assistant: dict[str, Any]) -> None:
        if body.get("store") is False:
            return
        pending = self._pending.pop(id(body), None)
        if pending is None or pending[0] is not body:
            return  # to_chat_request did not see this body (or it was evicted): nothing to chain
        self.store.put(response_id, [*pending[1], assistant])

    # --- response --------------------------------------------------------------------------
    def _envelope(
        self, body: dict[str, Any], response_id: str, created: float, status: str
    ) -> dict[str, Any]:
        return {
            "id": response_id,
            "object": "response",
            "created_at": created,
            "status": status,
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

    def from_chat_response(self, chat: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        response_id = _response_id(chat.get("id"))
        choices = chat.get("choices") or []
        choice = choices[0] if choices else {}
        message = choice.get("message") or {}
        status, incomplete = _status(choice.get("finish_reason"))
        response = self._envelope(body, response_id, chat.get("created") or time.time(), status)
        response["model"] = chat.get("model") or body.get("model")
        response["incomplete_details"] = incomplete
        output: list[dict[str, Any]] = []
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        if reasoning:
            output.append(_reasoning_item(f"rs_{response_id[5:]}", reasoning))
        if message.get("content"):
            output.append(_message_item(f"msg_{response_id[5:]}", message["content"], status))
        output += [_function_call_item(call, "completed") for call in message.get("tool_calls") or ()]
        response["output"] = output
        response["usage"] = _usage(chat.get("usage"))
        assistant: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            assistant["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": c["function"]} for c in message["tool_calls"]
            ]
        self._store(body, response_id, assistant)
        return response

    def stream_translator(self, body: dict[str, Any]) -> _ResponsesStream:
        return _ResponsesStream(self, body)

    def error_body(self, status: int, message: str, error_type: str, param: str | None = None) -> dict[str, Any]:
        return openai_error(status, message, error_type if error_type.islower() else "", param)


class _ResponsesStream:
    """chat.completion.chunk dicts in, Responses stream events out (choice 0 only)."""

    def __init__(self, adapter: ResponsesAdapter, body: dict[str, Any]) -> None:
        self._adapter = adapter
        self._body = body
        self._seq = 0
        self._response: dict[str, Any] | None = None
        self._output: list[dict[str, Any]] = []  # finished items
        self._item: dict[str, Any] | None = None  # the open item
        self._tool_index: int | None = None
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None
        self._text = ""
        self._tool_calls: list[dict[str, Any]] = []
        self._ended = False

    def _event(self, name: str, data: dict[str, Any]) -> bytes:
        data = {"type": name, "sequence_number": self._seq, **data}
        self._seq += 1
        return sse_event(name, data)

    def _start(self, chunk: dict[str, Any]) -> list[bytes]:
        self._response = self._adapter._envelope(
            self._body, _response_id(chunk.get("id")), chunk.get("created") or time.time(), "in_progress"
        )
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
        events.append(
            self._event("response.output_item.added", {"output_index": len(self._output), "item": item})
        )
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
            events.append(
                self._content_event("response.output_text.done", {"text": part["text"], "logprobs": []})
            )
            events.append(self._content_event("response.content_part.done", {"part": part}))
            item["status"] = "completed"
        elif kind == "reasoning":
            events.append(
                self._content_event("response.reasoning_text.done", {"text": item["content"][0]["text"]})
            )
        elif kind == "function_call":
            done = {
                "item_id": item["id"],
                "output_index": len(self._output),
                "name": item["name"],
                "arguments": item["arguments"],
            }
            events.append(self._event("response.function_call_arguments.done", done))
            item["status"] = "completed"
        events.append(
            self._event("response.output_item.done", {"output_index": len(self._output), "item": item})
        )
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
                if self._item is None or self._item["type"] != "reasoning":
                    events += self._open(_reasoning_item(self._item_id("rs"), ""))
                assert self._item is not None
                self._item["content"][0]["text"] += reasoning
                events.append(self._content_event("response.reasoning_text.delta", {"delta": reasoning}))
            if delta.get("content"):
                if self._item is None or self._item["type"] != "message":
                    events += self._open(_message_item(self._item_id("msg"), "", "in_progress"))
                assert self._item is not None
                self._item["content"][0]["text"] += delta["content"]
                self._text += delta["content"]
                events.append(
                    self._content_event(
                        "response.output_text.delta", {"delta": delta["content"], "logprobs": []}
                    )
                )
            for call in delta.get("tool_calls") or ():
                events += self._tool_call(call)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
                events += self._close()
        if self._finish_reason is not None and self._usage is not None:
            events += self._end()
        return events

    def _tool_call(self, call: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        index = call.get("index", 0)
        function = call.get("function") or {}
        if self._item is None or self._item["type"] != "function_call" or index != self._tool_index:
            item = _function_call_item(
                {"id": call.get("id"), "function": {"name": function.get("name")}}, "in_progress"
            )
            events += self._open(item)
            self._tool_index = index
            self._tool_calls.append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": ""},
                }
            )
        assert self._item is not None
        arguments = function.get("arguments")
        if arguments:
            self._item["arguments"] += arguments
            self._tool_calls[-1]["function"]["arguments"] += arguments
            delta = {"item_id": self._item["id"], "output_index": len(self._output), "delta": arguments}
            events.append(self._event("response.function_call_arguments.delta", delta))
        return events

    def _end(self) -> list[bytes]:
        if self._ended:
            return []
        self._ended = True
        events = self._close()
        assert self._response is not None
        status, incomplete = _status(self._finish_reason)
        response = {**self._response, "status": status, "incomplete_details": incomplete}
        if self._finish_reason is None:  # the engine's stream ended without a finish reason
            status = response["status"] = "failed"
            response["error"] = {
                "code": "server_error",
                "message": "the engine's stream ended before it finished",
            }
        response["output"] = self._output
        response["usage"] = _usage(self._usage)
        assistant: dict[str, Any] = {"role": "assistant", "content": self._text or None}
        if self._tool_calls:
            assistant["tool_calls"] = self._tool_calls
        self._adapter._store(self._body, response["id"], assistant)
        name = {"completed": "response.completed", "failed": "response.failed"}.get(
            status, "response.incomplete"
        )
        return [*events, self._event(name, {"response": response})]

    def finish(self) -> list[bytes]:
        events = [] if self._response is not None else self._start({})
        return events + self._end()


RESPONSES = ResponsesAdapter()
