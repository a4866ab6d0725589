"""The Responses API's WebSocket transport: `GET /v1/responses` upgraded (and under each rollout prefix).

The protocol Codex speaks (0.169.0, OpenAI's provider, or any provider with `supports_websockets =
true`; header `OpenAI-Beta: responses_websockets=2026-02-06`): one WebSocket per agent thread; the
client sends `{"type": "response.create", ...a Responses request body...}` as a text message and the
server answers with the same events a streamed HTTP response carries, one JSON text message each,
`response.completed` (or `.incomplete`, `.failed`) last. An error is one message `{"type": "error",
"status": N, "error": {...}}` (Codex reads `status` as the HTTP status it stands for); the
connection stays open for the next request. Requests are served one after the other.

Each `response.create` goes through the same translation (protocols/responses.py), proxy and span as
`POST /v1/responses`, with the upgrade request's headers (rollout prefix, auth, declared structure).
What only this transport has:
- `generate: false` (Codex's prewarm of a new connection): a completed response with no output,
  the engine not called, its conversation kept;
- `previous_response_id` with `store: false`: the connection keeps its own conversations (the last
  few), as OpenAI's WebSocket does, so Codex's incremental requests chain;
- any other message type (`response.processed` acknowledgements) is accepted and not answered.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from aiohttp import WSMsgType, web

from agl_sidecar import inputs
from agl_sidecar.protocols.base import ProtocolError, Translation
from agl_sidecar.protocols.responses import ConversationStore, ResponsesAdapter
from agl_sidecar.proxy.fronts import AdapterFront
from agl_sidecar.proxy.request import CHAT, DEEP_JSON
from agl_sidecar.routes.common import bad_input, openai_error, sidecar_of, unauthorized
from agl_sidecar.spans import durable

log = logging.getLogger("agl_sidecar.responses_ws")
CREATE = "response.create"
# Conversations a connection keeps for previous_response_id: Codex chains each request to the one before.
KEPT_PER_CONNECTION = 8
_encode = msgspec.json.Encoder().encode


def ws_frame(name: str, data: dict[str, Any]) -> bytes:
    """One event as this transport sends it: its JSON, one line (the sink's unit)."""
    return _encode(data) + b"\n"


class _Sink:
    """What the proxy streams a response into, in place of an HTTP stream: each event a text
    message. In durable mode the last write waits for the call's span, as over HTTP."""

    status = 200

    def __init__(self, socket: web.WebSocketResponse, persist: durable.Persist | None, log: durable.SpanLog | None) -> None:
        self._socket, self._persist, self._log = socket, persist, log
        self._held = b""
        self.prepared = False

    async def prepare(self, request: web.Request) -> None:
        self.prepared = True

    async def write(self, data: bytes) -> None:
        if self._persist is None:
            await self._send(data)
            return
        held, self._held = self._held, bytes(data)
        await self._send(held)

    async def write_eof(self, data: bytes = b"") -> None:
        if self._persist is not None:
            await self._persist()
        held, self._held = self._held, b""
        await self._send(held + data)
        if self._persist is not None:
            durable.delivered_now(self._log)

    async def _send(self, data: bytes) -> None:
        for line in data.split(b"\n"):
            if line:
                await self._socket.send_frame(line, WSMsgType.TEXT)


class _WebSocketFront(AdapterFront):
    def __init__(self, adapter: ResponsesAdapter, body: dict[str, Any], translation: Translation,
                 socket: web.WebSocketResponse) -> None:  # fmt: skip
        super().__init__(adapter, body, translation)
        self._socket = socket
        self._responses = adapter

    def stream_response(  # type: ignore[override]
        self, persist: durable.Persist | None, log: durable.SpanLog | None, content_type: str
    ) -> _Sink:
        return _Sink(self._socket, persist, log)

    def start_stream(self) -> None:
        self._translator = self._responses.stream_translator(self.original, frame=ws_frame)


async def responses_ws(request: web.Request) -> web.StreamResponse:
    sidecar = sidecar_of(request)
    if request.headers.get("Upgrade", "").lower() != "websocket":
        response = openai_error(
            405, f"{request.path}: POST a Responses request, or GET with `Upgrade: websocket` for the "
            "Responses WebSocket transport", "method_not_allowed",
        )  # fmt: skip
        response.headers["Allow"] = "POST"
        return response
    if not sidecar.harness_authorized(request):
        return unauthorized()
    try:
        sidecar.identity(request)  # ids a span cannot carry: refused before the upgrade
    except inputs.BadInput as exc:
        return bad_input(exc)
    socket = web.WebSocketResponse(max_msg_size=sidecar.config.max_body_bytes)
    await socket.prepare(request)
    adapter = ResponsesAdapter(ConversationStore(max_entries=KEPT_PER_CONNECTION), keep_unstored=True)
    async for message in socket:
        if message.type == WSMsgType.TEXT:
            await _serve(request, socket, adapter, message.data)
        elif message.type == WSMsgType.BINARY:
            await _error(socket, 400, "send each request as a text message (JSON), not binary")
    return socket


async def _serve(request: web.Request, socket: web.WebSocketResponse, adapter: ResponsesAdapter, data: str) -> None:
    """One client message: a `response.create` answered with its events, anything else ignored."""
    try:
        event = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        await _error(socket, 400, f"the message is not valid JSON: {exc}")
        return
    except RecursionError:
        await _error(socket, 400, DEEP_JSON)
        return
    if not isinstance(event, dict) or event.get("type") != CREATE:
        kind = event.get("type") if isinstance(event, dict) else None
        log.debug("responses websocket: a %r message, not answered", kind)
        return
    body = {key: value for key, value in event.items() if key not in ("type", "generate")}
    body["stream"] = True  # this transport streams every response
    try:
        translation = adapter.to_chat_request(body)
    except ProtocolError as exc:
        await _error(socket, exc.status, exc.message, exc.error_type, exc.param)
        return
    except RecursionError:
        await _error(socket, 400, DEEP_JSON)
        return
    if event.get("generate") is False:
        response = adapter.answer_without_generating(body)
        created = {"type": "response.created", "sequence_number": 0, "response": {**response, "status": "in_progress"}}
        await socket.send_frame(_encode(created), WSMsgType.TEXT)
        completed = {"type": "response.completed", "sequence_number": 1, "response": response}
        await socket.send_frame(_encode(completed), WSMsgType.TEXT)
        return
    front = _WebSocketFront(adapter, body, translation, socket)
    sidecar = sidecar_of(request)
    answer = await sidecar.proxy.handle(request, CHAT, front, msgspec.json.encode(translation.chat))
    if isinstance(answer, web.Response):  # refused or failed before streaming: the error, as an event
        await _error_from(socket, answer)


async def _error_from(socket: web.WebSocketResponse, answer: web.Response) -> None:
    try:
        error = msgspec.json.decode(answer.body or b"{}").get("error") or {}  # type: ignore[arg-type]
    except (msgspec.DecodeError, AttributeError):
        error = {}
    message = error.get("message") if isinstance(error, dict) else None
    await _error(socket, answer.status, str(message or answer.text), str(error.get("type") or ""), error.get("param"))


async def _error(socket: web.WebSocketResponse, status: int, message: str, error_type: str = "",
                 param: str | None = None) -> None:  # fmt: skip
    if not error_type or not error_type.islower():
        error_type = "server_error" if status >= 500 else "invalid_request_error"
    event = {
        "type": "error",
        "status": status,
        "error": {"type": error_type, "code": None, "message": message, "param": param},
        # the openai SDK's ResponseErrorEvent reads these at the top level
        "code": None,
        "message": message,
        "param": param,
        "sequence_number": 0,
    }
    try:
        await socket.send_frame(_encode(event), WSMsgType.TEXT)
    except ConnectionResetError:
        pass
