"""The hot path: one model call from the harness to the engine and back.

Forwarding: the gate, the engine picked and reached (a stale pooled connection resent once), the
answer recorded (proxy.recording) and passed on; streams as they arrive, each read's complete SSE
events in one write.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from agl import semconv
from agl_sidecar import inputs
from agl_sidecar.calls import wire
from agl_sidecar.calls.attribution import parse_traceparent
from agl_sidecar.proxy.engine_client import (
    EngineBrokeOff,
    EngineDisconnected,
    EngineResponse,
    EngineUnreachable,
    LocalResourcesExhausted,
    ResponseTooLarge,
)
from agl_sidecar.proxy.failures import client_gone, end_call
from agl_sidecar.proxy.fronts import declare
from agl_sidecar.proxy.gate import HeldTooLong
from agl_sidecar.proxy.litellm_upstream import complete_via_litellm
from agl_sidecar.proxy.parts import ProxyParts
from agl_sidecar.proxy.recording import StreamRecorder, record_unary
from agl_sidecar.proxy.request import (
    CHAT,
    OPERATIONS,
    UPSTREAM_PATHS,
    BadRequest,
    Flags,
    call_seed,
    decode_request,
    identity_from,
    read_body,
    upstream_authorization,
    upstream_body,
)
from agl_sidecar.proxy import sse
from agl_sidecar.proxy.routing import NoUpstream, Upstream
from agl_sidecar.proxy.sse import EventSplitter, EventTooLarge
from agl_sidecar.spans import durable
from agl_sidecar.calls.record import CallRecord

if TYPE_CHECKING:
    from agl_sidecar.proxy.fronts import AdapterFront, OpenAIFront

    Front = OpenAIFront | AdapterFront

log = logging.getLogger("agl_sidecar.proxy")


class Proxy:
    def __init__(self, parts: ProxyParts) -> None:
        self.parts = parts

    # --- entry ---------------------------------------------------------------------------------
    async def handle(self, request: web.Request, kind: str, front: Front, body: bytes | None = None) -> web.StreamResponse:
        parts = self.parts
        started = time.perf_counter()
        status = 500
        parts.foreground.begin()  # span building waits while this call has work to do
        try:
            response = await self._handle(request, kind, front, body)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = 499
            parts.metrics.client_disconnects += 1
            raise
        finally:
            parts.foreground.end()
            parts.metrics.observe(front.api, status, time.perf_counter() - started)

    async def _handle(self, request: web.Request, kind: str, front: Front, body: bytes | None) -> web.StreamResponse:
        parts = self.parts
        if body is None:
            try:
                body = await read_body(request, parts.config.max_body_bytes, parts.config.body_timeout_s)
            except inputs.BodyRefused as exc:
                return front.error(exc.status, exc.message, "invalid_request_error")
        try:
            parsed = decode_request(kind, body)
            identity = identity_from(request, parts.config.rollout_api_keys)
        except (BadRequest, inputs.BadInput) as exc:
            status = getattr(exc, "status", 400)
            return front.error(status, exc.message, "permission_error" if status == 403 else "invalid_request_error",
                               exc.param)
        if front.declared is not None:  # what a translated request's body declares (Codex's metadata)
            declare(identity, front.declared)
        mode = identity.mode or parts.config.default_mode
        overrides = parts.config.sampling.get(mode, {}) if mode else {}
        if parts.config.sampling_seed is not None and identity.rollout_id:  # reproducible sampling
            overrides = {**overrides, "seed": call_seed(parts.config.sampling_seed, identity, body)}
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
            n=overrides.get("n", parsed.n),  # the span says what the engine was asked for
            fields_dropped=front.fields_dropped,
            fields_passed=front.fields_passed,
            context_edits=front.context_edits,
        )
        if parts.config.capture_messages and kind == CHAT:
            call.input_messages = (b"[" + b",".join(bytes(m) for m in parsed.messages) + b"]").decode()  # type: ignore[union-attr]
        call.seq = parts.recorder.next_seq(identity)
        try:
            entering = parts.gate.enter()
            if parts.gate.paused:  # held: span building may use the time
                call.policy_version, call.held_ms = await parts.foreground.waiting(entering)
            else:
                call.policy_version, call.held_ms = await entering
        except HeldTooLong:
            parts.metrics.held_timeouts += 1
            call.policy_version = parts.gate.policy_version
            message = "held longer than max_hold_s while training paused the sidecar"
            end_call(parts, call, semconv.END_HELD_TIMEOUT, "held_timeout", message)
            response = front.error(
                503,
                f"the model is being updated and this call waited over {parts.config.max_hold_s:g} s; retry shortly",
                "service_unavailable",
            )
            response.headers["Retry-After"] = str(max(1, int(parts.config.max_hold_s // 10) or 1))
            return response
        except asyncio.CancelledError:
            client_gone(parts, call)
            raise
        call.switches = parts.gate.switches  # a drain-free switch may land while it runs
        try:
            return await self._dispatch(request, kind, front, body, parsed, call, overrides)
        except asyncio.CancelledError:  # the client went away while the engine worked
            client_gone(parts, call)
            raise
        except Exception as exc:  # a sidecar bug: answer clearly, keep the record
            log.exception("agl-sidecar: call failed inside the sidecar")
            if not call.finished:
                end_call(parts, call, semconv.END_UPSTREAM_ERROR, type(exc).__name__, str(exc)[:500])
            return front.error(500, f"agl-sidecar internal error: {type(exc).__name__}: {exc}", "internal_error")
        finally:
            parts.gate.leave()

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
        parts = self.parts
        try:
            upstream = parts.router.pick(call.identity.rollout_id)
        except NoUpstream:
            return self._fail(call, front, 502, "no upstream is configured", "upstream_unreachable")
        if upstream.litellm_model is not None:
            return await complete_via_litellm(parts, request, kind, front, body, parsed, call, upstream, overrides)
        out_body = upstream_body(body, kind, parsed, parts.config.inject_token_ids, overrides)
        tried: tuple[Upstream, ...] = ()
        # A pooled keep-alive connection the engine already closed (vLLM's default keep-alive is
        # 5 s) fails before any response arrives: resend once on a fresh connection.
        stale_connection_retries = 1
        while True:
            call.upstream = upstream.url
            headers = {"Content-Type": "application/json"}
            auth = upstream_authorization(parts.config, request, upstream)
            if auth:
                headers["Authorization"] = auth
            upstream.in_flight += 1
            try:
                upstream_response = await parts.foreground.waiting(
                    parts.engines().post(upstream.url, UPSTREAM_PATHS[kind], out_body, headers)
                )
            except EngineUnreachable as exc:
                upstream.in_flight -= 1
                parts.router.mark_down(upstream, f"connection failed: {exc}")
                tried += (upstream,)
                try:
                    upstream = parts.router.pick(call.identity.rollout_id, exclude=tried)
                except NoUpstream:
                    return self._fail(
                        call, front, 502, f"upstream {upstream.url} is unreachable ({exc})", "upstream_unreachable"
                    )
                continue
            except LocalResourcesExhausted as exc:  # this host's limit, not the engine's: it stays in service
                upstream.in_flight -= 1
                response = self._fail(call, front, 503, str(exc), "local_resources_exhausted")
                response.headers["Retry-After"] = "1"
                return response
            except EngineDisconnected as exc:
                upstream.in_flight -= 1
                if stale_connection_retries:
                    stale_connection_retries -= 1
                    continue
                return self._fail(call, front, 502, f"upstream {upstream.url} failed: {exc}", "upstream_error")
            except (EngineBrokeOff, TimeoutError) as exc:
                upstream.in_flight -= 1
                return self._fail(call, front, 502, f"upstream {upstream.url} failed: {exc}", "upstream_error")
            except BaseException:  # cancelled: the client went away before the engine answered
                upstream.in_flight -= 1
                raise
            break
        try:
            encoding = upstream_response.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):  # asked for identity: these bytes cannot be read nor passed on
                message = (f"upstream {upstream.url} answered with Content-Encoding: {encoding[:40]} although the "
                           "sidecar asked for identity (Accept-Encoding: identity); its body is not passed on")
                return self._fail(call, front, 502, message, "upstream_error")
            if upstream_response.status != 200:
                try:
                    data = await upstream_response.read(self.parts.config.max_response_bytes)
                except ResponseTooLarge:
                    data = b"(an error body over max_response_bytes)"
                except (EngineBrokeOff, TimeoutError) as exc:
                    data = f"(the error body broke off: {exc})".encode()
                message = data[:500].decode(errors="replace")
                end_call(
                    parts, call, semconv.END_UPSTREAM_ERROR, str(upstream_response.status), message, upstream_error=True
                )
                return front.upstream_error(
                    upstream_response.status, data, upstream_response.headers.get("content-type")
                )
            flags = Flags(kind, parsed)
            if parsed.stream:
                return await self._stream(request, kind, front, upstream_response, flags, call)
            return await self._unary(request, kind, front, upstream_response, flags, call)
        finally:
            upstream.in_flight -= 1
            upstream_response.close()

    def _fail(self, call: CallRecord, front: Front, status: int, message: str, error_type: str) -> web.Response:
        end_call(self.parts, call, semconv.END_UPSTREAM_ERROR, error_type, message, upstream_error=True)
        return front.error(status, message, error_type)

    # --- non-streaming -------------------------------------------------------------------------
    async def _unary(
        self,
        request: web.Request,
        kind: str,
        front: Front,
        upstream_response: EngineResponse,
        flags: Flags,
        call: CallRecord,
    ) -> web.StreamResponse:
        limit = self.parts.config.max_response_bytes
        try:
            data = await upstream_response.read(limit)  # the engine is done: a transfer, not a wait
        except asyncio.CancelledError:
            client_gone(self.parts, call)
            raise
        except (EngineBrokeOff, TimeoutError) as exc:
            return self._fail(call, front, 502, f"upstream {call.upstream} broke off: {exc}", "upstream_error")
        except ResponseTooLarge:
            message = f"upstream {call.upstream} answered a body over {limit} bytes (sidecar max_response_bytes)"
            return self._fail(call, front, 502, message, "upstream_error")
        try:
            out = record_unary(kind, data, flags, call, self.parts.config.capture_messages)
        except (msgspec.MsgspecError, RecursionError):
            out = data  # not an OpenAI body: pass it on untouched, record no tokens
            call.tokens_absent = True
        try:
            translated = front.unary(out)
        except (msgspec.MsgspecError, RecursionError, LookupError, TypeError, ValueError, AttributeError) as exc:
            message = f"upstream {call.upstream} answered a body that is not a chat completion ({exc!r})"[:500]
            return self._fail(call, front, 502, message, "upstream_error")
        response = durable.unary_response(  # durable mode: the span is on disk before the body goes
            self.parts.recorder.persister(call),
            self.parts.recorder.exporter.log,  # and marked delivered once the body is out
            status=200,
            body=translated,
            headers={"Content-Type": upstream_response.headers.get("content-type", "application/json")},
        )
        try:
            await response.prepare(request)
            await response.write_eof()
        except ConnectionResetError:
            self.parts.metrics.client_disconnects += 1
            client_gone(self.parts, call)
            return response
        except asyncio.CancelledError:
            client_gone(self.parts, call)
            raise
        self.parts.recorder.finish(call)
        return response

    # --- streaming -----------------------------------------------------------------------------
    async def _stream(
        self,
        request: web.Request,
        kind: str,
        front: Front,
        upstream_response: EngineResponse,
        flags: Flags,
        call: CallRecord,
    ) -> web.StreamResponse:
        content_type = upstream_response.headers.get("content-type", "text/event-stream; charset=utf-8")
        # durable mode: the last chunk waits for the span
        response = front.stream_response(self.parts.recorder.persister(call), self.parts.recorder.exporter.log, content_type)
        recorder = StreamRecorder(kind, flags, call)
        front.start_stream()
        splitter = EventSplitter()
        foreground = self.parts.foreground
        try:
            await response.prepare(request)
            while True:
                foreground.leave()  # Foreground.waiting inlined: a coroutine less per read of a stream
                try:
                    data = await upstream_response.readany()
                finally:
                    foreground.enter()
                if not data:
                    break
                events = splitter.feed(data)
                if not events:
                    continue
                out = front.stream([recorder.event(event) for event in events if event])
                if out:
                    await response.write(out)
            rest = splitter.rest()
            if rest:
                await response.write(front.stream([recorder.event(rest)]))
            tail = front.end_stream()
            if tail:
                await response.write(tail)
            await response.write_eof()
        except ConnectionResetError:  # the client went away: closing the upstream stops the engine
            self.parts.metrics.client_disconnects += 1
            client_gone(self.parts, call)
            return response  # aiohttp finishes a response to a gone client quietly
        except asyncio.CancelledError:  # counted by handle()
            client_gone(self.parts, call)
            raise
        except (EngineBrokeOff, TimeoutError, EventTooLarge) as exc:
            if isinstance(exc, EventTooLarge):
                exc = EngineBrokeOff(f"upstream sent an SSE event over {sse.MAX_EVENT_BYTES} bytes")
            end_call(self.parts, call, semconv.END_UPSTREAM_ERROR, "upstream_stream_broken", repr(exc), upstream_error=True)
            # The engine broke off: the harness must see a broken stream too, as it would talking
            # to the engine directly, never a clean end. Closing the connection without the chunked
            # terminator does that on every API (what was already sent is flushed first); aiohttp's
            # final write_eof then meets a closed transport, which it takes quietly.
            if request.transport is not None:
                request.transport.close()
            return response
        except Exception as exc:  # a sidecar bug mid-stream: the status line is long gone
            # An error response written now would land inside the chunked body (the harness's client
            # reads "illegal chunk header"): break the stream as a dying engine would, keep the record.
            if not response.prepared:
                raise
            log.exception("agl-sidecar: a stream failed inside the sidecar")
            if not call.finished:
                end_call(self.parts, call, semconv.END_UPSTREAM_ERROR, type(exc).__name__, str(exc)[:500])
            if request.transport is not None:
                request.transport.close()
            return response
        self.parts.recorder.finish(call)
        return response
