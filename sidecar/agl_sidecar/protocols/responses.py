"""The OpenAI Responses API (`POST /v1/responses`, and its WebSocket transport) over a chat engine.

A request is checked (responses_request.py: a known field with a wrong type or an impossible value
is a 400 naming it), then translated to a chat request here, without litellm: its options
(responses_options.py), tools (responses_tools.py: namespaces flattened, hosted tools dropped) and
input items (responses_input.py: each response's reasoning, message and calls back into the one
assistant message the engine wrote, so consecutive calls extend each other token for token). What
the sidecar does not know is never refused: each such part is dropped or passed and named in the
call's span (`Translation.dropped` / `.passed`). litellm's Responses bridge is not used because
what it does with such parts is not said (it turns `web_search` into `web_search_options` and
drops what it does not know), it has no notion of the sidecar's reasoning and compaction tokens,
and it cost about 1 ms per Codex-shaped request (bench/protocols_overhead.py measures both).

Responses and streams are built in responses_output.py and responses_stream.py; a compaction request
(`compaction_trigger`) is served by the engine (responses_compaction.py); the structure a request
declares in Codex's `client_metadata` goes to the span (responses_declared.py).

`previous_response_id`: the sidecar keeps each stored response's conversation (chat messages, the
response's own output included) in `ConversationStore`, bounded by count and by bytes (least
recently used first out), so a harness that chains responses works against a stateless engine. A
WebSocket connection keeps its own (`keep_unstored`): with `store: false` Codex chains each request
to the previous response of the same connection, as OpenAI's WebSocket allows.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec
from agl import semconv

from agl_sidecar.protocols._checks import refuse
from agl_sidecar.protocols._sse import sse_event
from agl_sidecar.protocols.base import ProtocolError, Translation
from agl_sidecar.protocols.responses_compaction import compaction_chat, summary_message
from agl_sidecar.protocols.responses_declared import Windows, declared
from agl_sidecar.protocols.responses_fates import Fates
from agl_sidecar.protocols.responses_input import translate_input
from agl_sidecar.protocols.responses_options import translate_options
from agl_sidecar.protocols.responses_output import (
    Reply,
    assistant_message,
    envelope,
    output_items,
    response_id,
    status as status_of,
    usage,
)
from agl_sidecar.protocols.responses_request import check_request
from agl_sidecar.protocols.responses_stream import Frame, ResponsesStream
from agl_sidecar.protocols.responses_tools import translate_tool_choice, translate_tools
from agl_sidecar.spans.lru import BytesLRU


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


@dataclass(slots=True)
class _Pending:
    """What translating a request left for its response: the conversation to keep, how to answer."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]]
    reply: Reply


_WINDOWS = Windows()  # Codex's context windows per thread, shared by every adapter of the process


class ResponsesAdapter:
    """POST /v1/responses (and each `response.create` of a WebSocket connection)."""

    api = semconv.API_RESPONSES
    path = "/responses"
    tokenize_only = False

    def __init__(
        self, store: ConversationStore | None = None, keep_unstored: bool = False, windows: Windows | None = None
    ) -> None:
        self.store = store or ConversationStore()
        self.keep_unstored = keep_unstored  # keep `store: false` conversations too (a WebSocket's own store)
        self.windows = windows or _WINDOWS
        # What to_chat_request built for a body, for its response; keyed by id(body), checked by
        # identity, bounded (a call that never got its answer is forgotten in time).
        self._pending: OrderedDict[int, _Pending] = OrderedDict()
        self._pending_limit = 4096

    def prepare(self) -> None:
        """Nothing to import: this adapter does not use litellm."""

    # --- request ---------------------------------------------------------------------------
    def to_chat_request(self, body: dict[str, Any]) -> Translation:
        if not isinstance(body, dict):
            raise ProtocolError(400, "request body must be a JSON object")
        request = check_request(body)
        fates = Fates()
        chat = translate_options(body, request, fates)
        tools = translate_tools(request.tools, fates)
        if tools.chat_tools:
            chat["tools"] = tools.chat_tools
        choice = translate_tool_choice(request.tool_choice, tools, fates)
        if choice is not None:
            chat["tool_choice"] = choice
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = self.store.get(request.previous_response_id)
            if stored is None:
                raise ProtocolError(
                    404,
                    f"Previous response with id '{request.previous_response_id}' not found "
                    "(the sidecar keeps a bounded number).",
                    param="previous_response_id",
                )
            history = stored
        items = translate_input(request.input, tools, fates)
        conversation = history + items.messages
        if not conversation:
            raise refuse("the input holds nothing the engine can be given", "input")
        # Instructions are not carried over from a previous response (as in OpenAI's API).
        chat["messages"] = (
            [{"role": "system", "content": request.instructions}] if request.instructions else []
        ) + conversation
        if items.compaction_request:
            compaction_chat(chat)
        structure = declared(
            request.client_metadata, items.after_compaction or items.compaction_request, self.windows, fates
        )
        self._remember(_Pending(body, conversation, Reply.of(body, items.compaction_request, tools)))
        return Translation(chat, fates.dropped_entries(), fates.passed_entries(), structure)

    def _remember(self, pending: _Pending) -> None:
        self._pending[id(pending.body)] = pending
        while len(self._pending) > self._pending_limit:
            self._pending.popitem(last=False)

    def _reply(self, body: dict[str, Any]) -> Reply:
        pending = self._pending.get(id(body))
        return pending.reply if pending is not None and pending.body is body else Reply.of(body)

    def keep(self, body: dict[str, Any], rid: str, assistant: dict[str, Any], summary: str) -> None:
        """Keep the conversation of `body` and its answer under `rid`, for `previous_response_id`."""
        pending = self._pending.pop(id(body), None)
        if pending is None or pending.body is not body:
            return  # to_chat_request did not see this body (or it was evicted): nothing to chain
        if body.get("store") is False and not self.keep_unstored:
            return
        # A compaction replaces the conversation: what follows it continues from the summary.
        kept = [summary_message(summary)] if pending.reply.compaction else [*pending.conversation, assistant]
        self.store.put(rid, kept)

    # --- response --------------------------------------------------------------------------
    def from_chat_response(self, chat: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        reply = self._reply(body)
        rid = response_id(chat.get("id"))
        choices = chat.get("choices") or []
        choice = choices[0] if choices else {}
        message = choice.get("message") or {}
        state, incomplete = status_of(choice.get("finish_reason"))
        response = envelope(body, rid, chat.get("created") or time.time(), state)
        response["model"] = chat.get("model") or body.get("model")
        response["incomplete_details"] = incomplete
        response["output"] = output_items(message, rid, state, reply)
        response["usage"] = usage(chat.get("usage"))
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        assistant = assistant_message(message.get("content"), reasoning, message.get("tool_calls") or [])
        self.keep(body, rid, assistant, message.get("content") or "")
        return response

    def answer_without_generating(self, body: dict[str, Any]) -> dict[str, Any]:
        """The completed, empty response to a request that asks for no output (a WebSocket
        `response.create` with `generate: false`: Codex warms a connection with one), its
        conversation kept for the next request to chain to. The engine is not called."""
        rid = f"resp_{uuid.uuid4().hex}"
        response = envelope(body, rid, time.time(), "completed")
        response["usage"] = usage(None)
        pending = self._pending.pop(id(body), None)
        if pending is not None and pending.body is body and (body.get("store") is not False or self.keep_unstored):
            self.store.put(rid, pending.conversation)
        return response

    def stream_translator(self, body: dict[str, Any], frame: Frame = sse_event) -> ResponsesStream:
        return ResponsesStream(self, body, self._reply(body), frame)

    def error_body(self, status: int, message: str, error_type: str, param: str | None = None) -> dict[str, Any]:
        return openai_error(status, message, error_type if error_type.islower() else "", param)


RESPONSES = ResponsesAdapter()
