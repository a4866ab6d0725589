"""What the harness speaks. The core produces OpenAI chat/completions bytes (already stripped of what
the harness did not ask for); a front delivers them: as-is for OpenAI clients, or translated by a
protocol adapter (Anthropic Messages, the Responses API) for the others."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from agl_sidecar.calls import wire
from agl_sidecar.calls.attribution import Identity
from agl_sidecar.protocols.base import Declared, ProtocolAdapter, StreamTranslator, Translation
from agl_sidecar.spans import durable

JSON = "application/json"
SSE = "text/event-stream; charset=utf-8"


class OpenAIFront:
    """Passes the engine's OpenAI responses through."""

    # The body goes to the engine as the harness sent it: no field is dropped, none read unknown,
    # nothing declared or edited (a declared compaction comes in the x-agl-compaction header).
    fields_dropped: tuple[str, ...] = ()
    fields_passed: tuple[str, ...] = ()
    declared: Declared | None = None
    context_edits: tuple[str, ...] = ()

    def __init__(self, api: str) -> None:
        self.api = api

    def error(self, status: int, message: str, error_type: str, param: str | None = None) -> web.Response:
        return web.Response(status=status, body=wire.error_body(message, error_type, param, status), content_type=JSON)

    def upstream_error(self, status: int, body: bytes, content_type: str | None) -> web.Response:
        headers = {"Content-Type": content_type} if content_type else None
        return web.Response(status=status, body=body, headers=headers)

    def unary(self, body: bytes) -> bytes:
        return body

    def stream_response(
        self, persist: durable.Persist | None, log: durable.SpanLog | None, content_type: str
    ) -> web.StreamResponse:
        """Where a stream goes: an HTTP stream response (`persist`: durable mode's wait for the span;
        `log`: where its delivery is marked once the last bytes went out)."""
        return durable.stream_response(persist, log, status=200, headers={"Content-Type": content_type})

    def start_stream(self) -> None:
        pass

    def stream(self, events: list[bytes]) -> bytes:
        """`events` are complete SSE event payloads (`data: ...`) without the blank-line separator."""
        return b"\n\n".join(events) + b"\n\n"

    def end_stream(self) -> bytes:
        return b""


class AdapterFront:
    """Translates chat responses and chunks to another protocol through its adapter."""

    def __init__(self, adapter: ProtocolAdapter, original: dict[str, Any], translation: Translation) -> None:
        self.adapter = adapter
        self.api = adapter.api
        self.original = original
        self.fields_dropped = translation.dropped
        self.fields_passed = translation.passed
        self.declared = translation.declared
        self.context_edits = translation.context_edits
        self._translator: StreamTranslator | None = None

    def error(self, status: int, message: str, error_type: str, param: str | None = None) -> web.Response:
        body = self.adapter.error_body(status, message, error_type)
        return web.Response(status=status, body=msgspec.json.encode(body), content_type=JSON)

    def upstream_error(self, status: int, body: bytes, content_type: str | None) -> web.Response:
        message = body.decode(errors="replace")
        error_type = "api_error"
        try:
            parsed = msgspec.json.decode(body)
            if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
                value = parsed["error"].get("message", message)
                message = value if isinstance(value, str) else msgspec.json.encode(value).decode()  # JSON, not a repr
                error_type = str(parsed["error"].get("type") or error_type)
        except msgspec.DecodeError:
            pass
        return self.error(status, message, error_type)

    def unary(self, body: bytes) -> bytes:
        chat = _decode(body)  # the engine's: a failure is the proxy's upstream error
        return msgspec.json.encode(self.adapter.from_chat_response(chat, self.original))

    def stream_response(
        self, persist: durable.Persist | None, log: durable.SpanLog | None, content_type: str
    ) -> web.StreamResponse:
        return durable.stream_response(persist, log, status=200, headers={"Content-Type": content_type})

    def start_stream(self) -> None:
        self._translator = self.adapter.stream_translator(self.original)

    def stream(self, events: list[bytes]) -> bytes:
        assert self._translator is not None
        out: list[bytes] = []
        for event in events:
            if not event.startswith(b"data: "):  # other SSE fields first: its data line is last
                at = event.rfind(b"\ndata: ")
                if at < 0:
                    continue
                event = event[at + 1 :]
            if event[6:].strip() == b"[DONE]":
                continue
            try:
                chunk = _decode(event[6:])
            except msgspec.DecodeError:
                continue  # not JSON: the recorder marked the call's tokens absent
            if isinstance(chunk, dict):
                try:
                    out += self._translator.feed(chunk)
                except (TypeError, AttributeError, LookupError, ValueError):
                    # A chunk not shaped as a chat chunk (`"choices": 5`): skipped, as one that is
                    # not JSON; the stream goes on (the recorder already marked the tokens absent).
                    continue
        return b"".join(out)

    def end_stream(self) -> bytes:
        assert self._translator is not None
        return b"".join(self._translator.finish())


def declare(identity: Identity, declared: Declared) -> None:
    """`identity` completed with what the request's body declares: the agents its headers did not
    declare (headers win), and a compaction either declares."""
    if identity.agent_id is None and identity.parent_agent_id is None:
        identity.agent_id, identity.parent_agent_id = declared.agent_id, declared.parent_agent_id
    identity.compaction = identity.compaction or declared.compaction


def _decode(data: bytes) -> Any:
    """The engine's JSON; as Python's `json` reads it when only that reads it (`NaN` in logprobs the
    harness asked for), the non-finite values then as strings."""
    return wire.decode_tolerant(msgspec.json.decode, data)
