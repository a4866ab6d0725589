"""Calls to `--upstream litellm:<provider/model>`: any provider litellm reaches, with spans of the same
shape as an engine's (hosted APIs give no token IDs: agl.tokens.source=absent). litellm is imported
on the first such call, never at startup (it costs seconds)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from agl import semconv
from agl_sidecar.proxy.failures import end_call
from agl_sidecar.inputs import int64_or_none
from agl_sidecar.proxy.request import CHAT
from agl_sidecar.calls.record import CallRecord

if TYPE_CHECKING:
    from agl_sidecar.proxy.parts import ProxyParts
    from agl_sidecar.proxy.routing import Upstream

# Fields only vLLM understands: litellm would forward or reject them.
_ENGINE_ONLY = ("return_token_ids", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos")


def _litellm() -> Any:
    import litellm

    litellm.drop_params = True  # providers differ in what they accept; never fail a call on an extra field
    return litellm


def _record(call: CallRecord, response: dict[str, Any]) -> None:
    call.response_id = response.get("id")
    call.response_model = response.get("model")
    for choice in response.get("choices") or []:
        record = call.choice(int64_or_none(choice.get("index", 0)) or 0)
        if choice.get("finish_reason"):
            record.finish_reason = str(choice["finish_reason"])
    usage = response.get("usage") or {}
    if usage:
        # A provider's counts as a span can carry them (int64), else left out.
        call.input_tokens = int64_or_none(usage.get("prompt_tokens"))
        call.output_tokens = int64_or_none(usage.get("completion_tokens"))


async def complete_via_litellm(
    parts: ProxyParts,
    request: web.Request,
    kind: str,
    front: Any,
    body: bytes,
    parsed: Any,
    call: CallRecord,
    upstream: Upstream,
    overrides: dict[str, Any],
) -> web.StreamResponse:
    call.upstream = upstream.url
    call.tokens_absent = True
    model = upstream.litellm_model or ""
    call.provider = model.split("/", 1)[0] if "/" in model else "litellm"
    if kind != CHAT:
        end_call(parts, call, semconv.END_UPSTREAM_ERROR, "unsupported")
        return front.error(400, "a litellm: upstream serves /v1/chat/completions only", "invalid_request_error")
    data = msgspec.json.decode(body)
    data.update(overrides)
    for key in _ENGINE_ONLY:
        data.pop(key, None)
    data["model"] = model
    data.update(parts.config.litellm_params)
    waiting = parts.foreground.waiting  # a hosted provider's latency is time for span building
    litellm = await waiting(asyncio.get_running_loop().run_in_executor(None, _litellm))
    try:
        result = await waiting(litellm.acompletion(**data))
    except Exception as exc:  # litellm maps provider errors to exceptions carrying a status
        status = int(getattr(exc, "status_code", 502) or 502)
        end_call(parts, call, semconv.END_UPSTREAM_ERROR, type(exc).__name__, str(exc)[:500], upstream_error=True)
        return front.error(status if 400 <= status < 600 else 502, f"upstream {model}: {exc}", "upstream_error")
    if not data.get("stream"):
        response_dict = result.model_dump(exclude_none=False)
        _record(call, response_dict)
        out = web.Response(status=200, body=front.unary(msgspec.json.encode(response_dict)), content_type="application/json")
        await out.prepare(request)
        await out.write_eof()
        parts.recorder.finish(call)
        return out
    stream = front.stream_response(None, None, "text/event-stream; charset=utf-8")
    front.start_stream()
    try:
        await stream.prepare(request)
        async for chunk in result:
            chunk_dict = chunk.model_dump(exclude_none=True)
            _record(call, chunk_dict)
            await stream.write(front.stream([b"data: " + msgspec.json.encode(chunk_dict)]))
        await stream.write(front.stream([b"data: [DONE]"]) + front.end_stream())
        await stream.write_eof()
    except (ConnectionResetError, asyncio.CancelledError):
        end_call(parts, call, semconv.END_CLIENT_DISCONNECTED, "client_disconnected")
        raise
    except Exception as exc:  # the provider broke off mid-stream: a broken stream for the harness too
        message = f"{type(exc).__name__}: {exc}"[:500]
        end_call(parts, call, semconv.END_UPSTREAM_ERROR, "upstream_stream_broken", message, upstream_error=True)
        if request.transport is not None:
            request.transport.close()
        return stream
    parts.recorder.finish(call)
    return stream
