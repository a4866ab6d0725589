"""The hot path: one model call from the harness to the engine and back.

The request is typed once (msgspec, only the fields the sidecar reads) and forwarded as bytes with
`return_token_ids` / logprobs appended when the harness did not ask for them. The response is typed
once to record token IDs and logprobs, then the fields the harness did not ask for are nulled in the
original bytes, so the harness receives what the engine would have sent it without the sidecar.
Streams are passed on as they arrive, each read's complete SSE events in one write.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web

from agl import semconv
from agl_sidecar import durable, inputs, wire
from agl_sidecar.attribution import Identity, parse_traceparent
from agl_sidecar.gate import HeldTooLong
from agl_sidecar.routing import NoUpstream, Upstream
from agl_sidecar.spans import CallRecord

if TYPE_CHECKING:
    from agl_sidecar.app import Sidecar
    from agl_sidecar.fronts import AdapterFront, OpenAIFront

    Front = OpenAIFront | AdapterFront

log = logging.getLogger("agl_sidecar.proxy")

CHAT = "chat"
COMPLETIONS = "completions"
UPSTREAM_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
OPERATIONS = {CHAT: semconv.OPERATION_CHAT, COMPLETIONS: semconv.OPERATION_TEXT_COMPLETION}

K_TOKEN_IDS = b'"token_ids":'
K_PROMPT_TOKEN_IDS = b'"prompt_token_ids":'
K_LOGPROBS = b'"logprobs":'
DATA = b"data: "
DONE = b"[DONE]"


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def decode_request(kind: str, body: bytes) -> wire.Request:
    """The typed request, or BadRequest naming what is wrong."""
    decoder = wire.chat_request if kind == CHAT else wire.completion_request
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        param = wire.error_param(exc)
        text = str(exc)
        if text.startswith("Object missing required field"):
            field = text.split("`")[1] if "`" in text else None
            return _raise(f"missing required field '{field}'", field)
        return _raise(f"invalid request body: {text}", param)
    except msgspec.DecodeError as exc:
        if not body.strip():
            return _raise("empty request body: send a JSON object", None)
        return _raise(f"request body is not valid JSON: {exc}", None)
    except RecursionError:
        return _raise(DEEP_JSON, None)


DEEP_JSON = "request body is nested too deeply: JSON arrays and objects nested about 900 levels or more"


def _raise(message: str, param: str | None) -> Any:
    raise BadRequest(message, param)


class Flags:
    """What the harness asked the engine for, i.e. what must reach it."""

    __slots__ = ("token_ids", "logprobs")

    def __init__(self, kind: str, request: wire.Request) -> None:
        self.token_ids = bool(request.return_token_ids)
        if kind == CHAT:
            self.logprobs = bool(request.logprobs)
        else:
            self.logprobs = request.logprobs is not None

    @property
    def strips(self) -> bool:
        return not (self.token_ids and self.logprobs)


def upstream_body(
    body: bytes, kind: str, request: wire.Request, inject: bool, overrides: dict[str, Any]
) -> bytes:
    """The request for the engine: the harness's bytes plus the token flags and sampling overrides.

    Keys the harness did not send are appended before the closing brace (no re-encoding); when a key
    it did send must change, the body is re-encoded so it holds each key once."""
    add: dict[str, Any] = {}
    if inject:
        if not request.return_token_ids:
            add["return_token_ids"] = True
        if kind == CHAT:
            if not request.logprobs:
                add["logprobs"] = True
                if request.top_logprobs is None:
                    add["top_logprobs"] = 0
        elif request.logprobs is None:
            add["logprobs"] = 1
    add.update(overrides)
    if not add:
        return body
    rewrite = bool(overrides) or request.return_token_ids is False or (kind == CHAT and request.logprobs is False)
    if rewrite:
        data = msgspec.json.decode(body)
        data.update(add)
        return msgspec.json.encode(data)
    end = body.rfind(b"}")
    head = body[:end].rstrip()
    extra = b",".join(b'"' + key.encode() + b'":' + msgspec.json.encode(value) for key, value in add.items())
    return head + (b"" if head.endswith(b"{") else b",") + extra + b"}"


class Proxy:
    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar

    # --- entry ---------------------------------------------------------------------------------
    async def handle(self, request: web.Request, kind: str, front: Front, body: bytes | None = None) -> web.StreamResponse:
        sidecar = self.sidecar
        started = time.perf_counter()
        status = 500
        sidecar.foreground.begin()  # span building waits while this call has work to do
        try:
            response = await self._handle(request, kind, front, body)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = 499
            sidecar.metrics.client_disconnects += 1
            raise
        finally:
            sidecar.foreground.end()
            sidecar.metrics.observe(front.api, status, time.perf_counter() - started)

    async def _handle(self, request: web.Request, kind: str, front: Front, body: bytes | None) -> web.StreamResponse:
        sidecar = self.sidecar
        if body is None:
            try:
                body = await read_body(request, sidecar.config.max_body_bytes)
            except inputs.TooLarge as exc:
                return front.error(413, exc.message, "invalid_request_error")
        try:
            parsed = decode_request(kind, body)
            identity = sidecar.identity(request)
        except (BadRequest, inputs.BadInput) as exc:
            return front.error(400, exc.message, "invalid_request_error", exc.param)
        mode = identity.mode or sidecar.config.default_mode
        overrides = sidecar.config.sampling.get(mode, {}) if mode else {}
        call = CallRecord(
            api=front.api,
            operation=OPERATIONS[kind],
            identity=identity,
            trace_parent=parse_traceparent(request.headers.get("traceparent")),
            start_ns=time.time_ns(),
            model=parsed.model or "",
            stream=bool(parsed.stream),
            temperature=overrides.get("temperature", parsed.temperature),
            top_p=overrides.get("top_p", parsed.top_p),
            max_tokens=overrides.get("max_tokens", parsed.max_tokens),
            n=parsed.n,
        )
        if sidecar.config.capture_messages and kind == CHAT:
            call.input_messages = (b"[" + b",".join(bytes(m) for m in parsed.messages) + b"]").decode()  # type: ignore[union-attr]
        call.seq = sidecar.recorder.next_seq(identity)
        try:
            entering = sidecar.gate.enter()
            if sidecar.gate.paused:  # held: span building may use the time
                call.policy_version, call.held_ms = await sidecar.foreground.waiting(entering)
            else:
                call.policy_version, call.held_ms = await entering
        except HeldTooLong:
            sidecar.metrics.held_timeouts += 1
            call.end_reason = semconv.END_HELD_TIMEOUT
            call.error_type = "held_timeout"
            call.error_message = "held longer than max_hold_s while training paused the sidecar"
            call.policy_version = sidecar.gate.policy_version
            sidecar.recorder.finish(call)
            response = front.error(
                503,
                f"the model is being updated and this call waited over {sidecar.config.max_hold_s:g} s; retry shortly",
                "service_unavailable",
            )
            response.headers["Retry-After"] = str(max(1, int(sidecar.config.max_hold_s // 10) or 1))
            return response
        except asyncio.CancelledError:
            _client_gone(sidecar, call)
            raise
        try:
            return await self._dispatch(request, kind, front, body, parsed, call, overrides)
        except asyncio.CancelledError:  # the client went away while the engine worked
            _client_gone(sidecar, call)
            raise
        except Exception as exc:  # a sidecar bug: answer clearly, keep the record
            log.exception("agl-sidecar: call failed inside the sidecar")
            if not call.finished:
                call.end_reason = semconv.END_UPSTREAM_ERROR
                call.error_type = type(exc).__name__
                call.error_message = str(exc)[:500]
                sidecar.recorder.finish(call)
            return front.error(500, f"agl-sidecar internal error: {type(exc).__name__}: {exc}", "internal_error")
        finally:
            sidecar.gate.leave()

    async def _dispatch(
        self,
        request: web.Request,
        kind: str,
        front: Front,
        body: bytes,
        parsed: wire.Request,
        call: CallRecord,
        overrides: dict[str, Any],
    ) -> web.StreamResponse:
        sidecar = self.sidecar
        try:
            upstream = sidecar.router.pick(call.identity.rollout_id)
        except NoUpstream:
            return self._fail(call, front, 502, "no upstream is configured", "upstream_unreachable")
        if upstream.litellm_model is not None:
            from agl_sidecar.litellm_upstream import complete_via_litellm

            return await complete_via_litellm(sidecar, request, kind, front, body, parsed, call, upstream, overrides)
        out_body = upstream_body(body, kind, parsed, sidecar.config.inject_token_ids, overrides)
        tried: tuple[Upstream, ...] = ()
        # A pooled keep-alive connection the engine already closed (vLLM's default keep-alive is
        # 5 s) fails before any response arrives: resend once on a fresh connection.
        stale_connection_retries = 1
        while True:
            call.upstream = upstream.url
            headers = {"Content-Type": "application/json"}
            auth = sidecar.upstream_authorization(request, upstream)
            if auth:
                headers["Authorization"] = auth
            upstream.in_flight += 1
            try:
                upstream_response = await sidecar.foreground.waiting(
                    sidecar.session.post(upstream.url + UPSTREAM_PATHS[kind], data=out_body, headers=headers)
                )
            except aiohttp.ClientConnectorError as exc:
                upstream.in_flight -= 1
                sidecar.router.mark_down(upstream, f"connection failed: {exc}")
                tried += (upstream,)
                try:
                    upstream = sidecar.router.pick(call.identity.rollout_id, exclude=tried)
                except NoUpstream:
                    return self._fail(
                        call, front, 502, f"upstream {upstream.url} is unreachable ({exc})", "upstream_unreachable"
                    )
                continue
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                upstream.in_flight -= 1
                if stale_connection_retries:
                    stale_connection_retries -= 1
                    continue
                return self._fail(call, front, 502, f"upstream {upstream.url} failed: {exc!r}", "upstream_error")
            except (aiohttp.ClientError, TimeoutError) as exc:
                upstream.in_flight -= 1
                return self._fail(call, front, 502, f"upstream {upstream.url} failed: {exc!r}", "upstream_error")
            except BaseException:  # cancelled: the client went away before the engine answered
                upstream.in_flight -= 1
                raise
            break
        try:
            if upstream_response.status != 200:
                data = await upstream_response.read()
                call.end_reason = semconv.END_UPSTREAM_ERROR
                call.error_type = str(upstream_response.status)
                call.error_message = data[:500].decode(errors="replace")
                sidecar.metrics.upstream_errors += 1
                sidecar.recorder.finish(call)
                return front.upstream_error(
                    upstream_response.status, data, upstream_response.headers.get("Content-Type")
                )
            flags = Flags(kind, parsed)
            if parsed.stream:
                return await self._stream(request, kind, front, upstream_response, flags, call)
            return await self._unary(request, kind, front, upstream_response, flags, call)
        finally:
            upstream.in_flight -= 1
            upstream_response.close()

    def _fail(self, call: CallRecord, front: Front, status: int, message: str, error_type: str) -> web.Response:
        self.sidecar.metrics.upstream_errors += 1
        call.end_reason = semconv.END_UPSTREAM_ERROR
        call.error_type = error_type
        call.error_message = message
        self.sidecar.recorder.finish(call)
        return front.error(status, message, error_type)

    # --- non-streaming -------------------------------------------------------------------------
    async def _unary(
        self,
        request: web.Request,
        kind: str,
        front: Front,
        upstream_response: aiohttp.ClientResponse,
        flags: Flags,
        call: CallRecord,
    ) -> web.StreamResponse:
        try:
            data = await upstream_response.read()  # the engine is done: a transfer, not a wait
        except asyncio.CancelledError:
            _client_gone(self.sidecar, call)
            raise
        except aiohttp.ClientError as exc:
            return self._fail(call, front, 502, f"upstream {call.upstream} broke off: {exc!r}", "upstream_error")
        try:
            out = record_unary(kind, data, flags, call, self.sidecar.config.capture_messages)
        except (msgspec.MsgspecError, RecursionError):
            out = data  # not an OpenAI body: pass it on untouched, record no tokens
            call.tokens_absent = True
        try:
            translated = front.unary(out)
        except (msgspec.MsgspecError, RecursionError, LookupError, TypeError, ValueError, AttributeError) as exc:
            message = f"upstream {call.upstream} answered a body that is not a chat completion ({exc!r})"[:500]
            return self._fail(call, front, 502, message, "upstream_error")
        response = durable.unary_response(  # durable mode: the span is on disk before the body goes
            self.sidecar.recorder.persister(call),
            status=200,
            body=translated,
            headers={"Content-Type": upstream_response.headers.get("Content-Type", "application/json")},
        )
        try:
            await response.prepare(request)
            await response.write_eof()
        except ConnectionResetError:
            self.sidecar.metrics.client_disconnects += 1
            _client_gone(self.sidecar, call)
            return response
        except asyncio.CancelledError:
            _client_gone(self.sidecar, call)
            raise
        self.sidecar.recorder.finish(call)
        return response

    # --- streaming -----------------------------------------------------------------------------
    async def _stream(
        self,
        request: web.Request,
        kind: str,
        front: Front,
        upstream_response: aiohttp.ClientResponse,
        flags: Flags,
        call: CallRecord,
    ) -> web.StreamResponse:
        content_type = upstream_response.headers.get("Content-Type", "text/event-stream; charset=utf-8")
        response = durable.stream_response(  # durable mode: the last chunk waits for the span
            self.sidecar.recorder.persister(call), status=200, headers={"Content-Type": content_type}
        )
        recorder = StreamRecorder(kind, flags, call)
        front.start_stream()
        # The start of an event not yet complete, as received: an event that spans reads (the first
        # one carries the prompt's IDs, 200 KB for a 30k-char prompt) is searched and joined once,
        # not once per read.
        partial: list[bytes] = []
        foreground = self.sidecar.foreground
        carriage_return = False  # a read ended in CR: its LF may start the next read
        try:
            await response.prepare(request)
            while data := await foreground.waiting(upstream_response.content.readany()):
                if carriage_return or b"\r" in data:  # SSE also ends lines with CRLF or CR
                    data, carriage_return = _lf_lines(data, carriage_return)
                    if not data:
                        continue
                if partial:
                    if b"\n\n" not in data and not (partial[-1][-1:] == b"\n" and data[:1] == b"\n"):
                        partial.append(data)
                        continue
                    partial.append(data)
                    data = b"".join(partial)
                    partial.clear()
                events = data.split(b"\n\n")
                rest = events.pop()
                if rest:
                    partial.append(rest)
                if not events:
                    continue
                out = front.stream([recorder.event(event) for event in events if event])
                if out:
                    await response.write(out)
            rest = b"".join(partial).strip()
            if rest:
                await response.write(front.stream([recorder.event(rest)]))
            tail = front.end_stream()
            if tail:
                await response.write(tail)
            await response.write_eof()
        except ConnectionResetError:  # the client went away: closing the upstream stops the engine
            self.sidecar.metrics.client_disconnects += 1
            _client_gone(self.sidecar, call)
            return response  # aiohttp finishes a response to a gone client quietly
        except asyncio.CancelledError:  # counted by handle()
            _client_gone(self.sidecar, call)
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            call.end_reason = semconv.END_UPSTREAM_ERROR
            call.error_type = "upstream_stream_broken"
            call.error_message = repr(exc)
            self.sidecar.metrics.upstream_errors += 1
            self.sidecar.recorder.finish(call)
            # The engine broke off: the harness must see a broken stream too, as it would talking
            # to the engine directly, never a clean end. Closing the connection without the chunked
            # terminator does that on every API (what was already sent is flushed first); aiohttp's
            # final write_eof then meets a closed transport, which it takes quietly.
            if request.transport is not None:
                request.transport.close()
            return response
        self.sidecar.recorder.finish(call)
        return response


def _lf_lines(data: bytes, carriage_return: bool) -> tuple[bytes, bool]:
    """`data` with CRLF and CR line ends as LF, and whether it ended in a CR (held back: with the
    LF that may begin the next read it is one line end, not two)."""
    if carriage_return:
        data = b"\r" + data
    held = data.endswith(b"\r")
    if held:
        data = data[:-1]
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n"), held


def record_usage(call: CallRecord, usage: wire.Usage) -> None:
    """The engine's token counts; a count a span cannot carry (beyond int64) is left out."""
    call.input_tokens = inputs.int64_or_none(usage.prompt_tokens)
    call.output_tokens = inputs.int64_or_none(usage.completion_tokens)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, or inputs.TooLarge past `limit` bytes: a declared length over it is refused
    before a byte is read, an undeclared one (chunked) as soon as it passes it."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise inputs.TooLarge(limit)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise inputs.TooLarge(limit) from None


def _client_gone(sidecar: Sidecar, call: CallRecord) -> None:
    """The harness went away: record the call as ended by it (once; a finished call is not changed,
    its span is built from it later)."""
    if call.finished:
        return
    call.end_reason = semconv.END_CLIENT_DISCONNECTED
    call.error_type = "client_disconnected"
    sidecar.recorder.finish(call)


def _record_choice(call: CallRecord, c: Any, flags: Flags, strip: list[tuple[bytes, msgspec.Raw]]) -> None:
    """Record one choice (its token IDs and logprobs as the engine's JSON, decoded off the hot path by
    the span builder); queue what the harness did not ask for."""
    choice = call.choice(c.index)
    choice.finish_reason = c.finish_reason
    choice.token_ids = c.token_ids
    choice.logprobs = c.logprobs
    if not flags.token_ids:
        strip.append((K_TOKEN_IDS, c.token_ids))
    if not flags.logprobs:
        strip.append((K_LOGPROBS, c.logprobs))


def record_unary(kind: str, data: bytes, flags: Flags, call: CallRecord, capture: bool) -> bytes:
    """Record the response's ids, tokens and logprobs on `call`; return the body for the harness."""
    strip: list[tuple[bytes, msgspec.Raw]] = []
    if kind == CHAT:
        parsed = wire.decode_lifted(wire.chat_response, data, "prompt_token_ids")
        prompt_raw = parsed.prompt_token_ids
        if not flags.token_ids:
            strip.append((K_PROMPT_TOKEN_IDS, prompt_raw))
        for c in parsed.choices:
            _record_choice(call, c, flags, strip)
        if capture:
            call.output_messages = msgspec.json.encode(
                [msgspec.json.decode(c.message) for c in parsed.choices]
            ).decode()
    else:
        parsed = wire.completion_response.decode(data)
        prompt_raw = parsed.choices[0].prompt_token_ids if parsed.choices else wire.NULL
        for c in parsed.choices:
            _record_choice(call, c, flags, strip)
            if not flags.token_ids:  # completions carry the prompt's IDs per choice
                strip.append((K_PROMPT_TOKEN_IDS, c.prompt_token_ids))
    call.prompt_ids = None if prompt_raw == wire.NULL else prompt_raw
    call.response_id = parsed.id
    call.response_model = parsed.model
    if parsed.usage is not None:
        record_usage(call, parsed.usage)
    return wire.strip(data, strip, flags.token_ids, flags.logprobs) if strip else data


class StreamRecorder:
    """Assembles token IDs and logprobs from a stream's chunks and strips each event."""

    __slots__ = ("kind", "flags", "call", "_decode")

    def __init__(self, kind: str, flags: Flags, call: CallRecord) -> None:
        self.kind = kind
        self.flags = flags
        self.call = call
        self._decode = wire.chat_chunk.decode if kind == CHAT else wire.completion_chunk.decode

    def event(self, event: bytes) -> bytes:
        if not event.startswith(DATA):
            return self._event_lines(event)
        payload = event[6:]
        if payload == DONE:
            return event
        if self.kind == CHAT:
            fast = self._chat_fast(payload)
            if fast is not None:
                return fast
        try:
            chunk = self._decode(payload)
        except msgspec.MsgspecError:
            return self._event_lines(event) if b"\n" in event else event
        call = self.call
        if chunk.error is not None:
            call.end_reason = semconv.END_UPSTREAM_ERROR
            call.error_type = "upstream_stream_error"
            call.error_message = chunk.error.message or ""
            return event
        if call.response_id is None:
            call.response_id = chunk.id
            call.response_model = chunk.model
        if chunk.usage is not None:
            record_usage(call, chunk.usage)
        strip: list[tuple[bytes, msgspec.Raw]] = []
        flags = self.flags
        if self.kind == CHAT and call.prompt_ids is None and chunk.prompt_token_ids != wire.NULL:
            call.prompt_ids = chunk.prompt_token_ids
        if self.kind == CHAT and not flags.token_ids:
            strip.append((K_PROMPT_TOKEN_IDS, chunk.prompt_token_ids))
        for c in chunk.choices:
            choice = call.choice(c.index)
            if c.finish_reason is not None:
                choice.finish_reason = c.finish_reason
            ids = wire.token_ids(c.token_ids)
            if ids:
                choice.token_ids += ids
            if self.kind == CHAT:
                logprobs = wire.chat_logprobs(c.logprobs)
            else:
                logprobs = wire.legacy_logprobs(c.logprobs)
                if call.prompt_ids is None and c.index == 0 and c.prompt_token_ids != wire.NULL:
                    call.prompt_ids = c.prompt_token_ids
                if not flags.token_ids:
                    strip.append((K_PROMPT_TOKEN_IDS, c.prompt_token_ids))
            if logprobs:
                choice.logprobs += logprobs
            if not flags.token_ids:
                strip.append((K_TOKEN_IDS, c.token_ids))
            if not flags.logprobs:
                strip.append((K_LOGPROBS, c.logprobs))
        if strip:
            return DATA + wire.strip(payload, strip, flags.token_ids, flags.logprobs)
        return event


    def _event_lines(self, event: bytes) -> bytes:
        """An event not spelled `data: <one JSON line>` (vLLM's): `data:` without the space, other
        fields (`event:`, `id:`, comments), JSON over several `data:` lines. Its data is handled as
        one `data: ` line; the other lines are kept before it."""
        data: list[bytes] = []
        other: list[bytes] = []
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif line:
                other.append(line)
        if not data:
            return event
        payload = b"\n".join(data)
        if b"\n" in payload:  # JSON written over several lines: one line, as vLLM writes it
            try:
                payload = wire.encode(wire.decode_any(payload))
            except (msgspec.MsgspecError, RecursionError):
                return event
        return b"\n".join([*other, self.event(DATA + payload)])

    def _chat_fast(self, payload: bytes) -> bytes | None:
        """The common chat chunk (at most one choice) in one typed decode, its stripped fields found
        by markers: vLLM writes `"logprobs":{...}` right before `,"finish_reason":`, and `"key":` /
        `,"key":` with unescaped quotes cannot occur inside a JSON string. None: use the general path."""
        try:
            chunk = wire.decode_lifted(wire.typed_chat_chunk, payload, "prompt_token_ids")
        except msgspec.MsgspecError:
            return None
        if chunk.error is not None or len(chunk.choices) > 1:
            return None
        call = self.call
        flags = self.flags
        c = chunk.choices[0] if chunk.choices else None
        # Locate every value to strip before recording anything, and confirm each located span of
        # bytes is exactly the decoded value (another engine's spacing or key order moves them): on
        # a miss the general path handles the chunk from scratch.
        cuts: list[tuple[int, int]] = []
        has_prompt = chunk.prompt_token_ids != wire.NULL
        if has_prompt and not flags.token_ids:
            at = payload.rfind(b'"prompt_token_ids":[')
            end = payload.find(b"]", at) + 1
            if at < 0 or payload[at + 19 : end] != bytes(chunk.prompt_token_ids):
                return None
            cuts.append((at + 19, end))
        logprobs = None
        if c is not None:
            if c.token_ids is not None and not flags.token_ids:
                at = payload.rfind(b'"token_ids":[')
                end = payload.find(b"]", at) + 1
                if at < 0 or payload[at + 12 : end] != wire.encode(c.token_ids):
                    return None
                cuts.append((at + 12, end))
            if c.logprobs != wire.NULL:
                if not flags.logprobs:
                    at = payload.find(b'"logprobs":{')
                    end = payload.find(b',"finish_reason":', at)
                    if at < 0 or end < 0 or payload[at + 11 : end] != bytes(c.logprobs):
                        return None
                    cuts.append((at + 11, end))
                try:
                    logprobs = wire.chat_logprobs(c.logprobs)
                except msgspec.MsgspecError:
                    return None
        if len(cuts) > 1:
            cuts.sort()
            for (_, previous_end), (begin, _) in zip(cuts, cuts[1:]):
                if begin < previous_end:
                    return None  # two located values overlap: the layout is not vLLM's
        if has_prompt and call.prompt_ids is None:
            call.prompt_ids = chunk.prompt_token_ids
        if c is not None:
            choice = call.choice(c.index)
            if c.finish_reason is not None:
                choice.finish_reason = c.finish_reason
            if c.token_ids:
                choice.token_ids += c.token_ids
            if logprobs:
                choice.logprobs += logprobs
        if call.response_id is None:
            call.response_id = chunk.id
            call.response_model = chunk.model
        if chunk.usage is not None:
            record_usage(call, chunk.usage)
        if not cuts:
            return DATA + payload
        out = [DATA]
        position = 0
        for begin, end in cuts:
            out.append(payload[position:begin])
            out.append(b"null")
            position = end
        out.append(payload[position:])
        return b"".join(out)


def identity_from(request: web.Request, api_key_rollouts: dict[str, str]) -> Identity:
    from agl_sidecar.attribution import resolve

    info = request.match_info
    return resolve(request.headers, info.get("rollout_id"), info.get("attempt"), api_key_rollouts)
