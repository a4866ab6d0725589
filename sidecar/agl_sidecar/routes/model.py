"""Model routes: /v1/chat/completions, /v1/completions, /v1/models and the translated protocols'
paths (/v1/messages, /v1/responses, ...), each also under a rollout prefix."""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from agl import semconv
from agl_sidecar.protocols.base import ProtocolError
from agl_sidecar.protocols.registry import load_adapter
from agl_sidecar import inputs
from agl_sidecar.proxy.fronts import JSON, AdapterFront, OpenAIFront
from agl_sidecar.proxy.request import CHAT, COMPLETIONS, DEEP_JSON, read_body, upstream_authorization
from agl_sidecar.proxy.routing import NoUpstream
from agl_sidecar.routes.common import bad_input, json_reply, openai_error, sidecar_of, unauthorized
from agl_sidecar.routes.steps import engine_tokenize, run_step
from agl_sidecar.sidecar import Sidecar


async def chat(request: web.Request) -> web.StreamResponse:
    sidecar = sidecar_of(request)
    if not sidecar.harness_authorized(request):
        return unauthorized()
    return await sidecar.proxy.handle(request, CHAT, OpenAIFront(semconv.API_CHAT_COMPLETIONS))


async def completions(request: web.Request) -> web.StreamResponse:
    sidecar = sidecar_of(request)
    if not sidecar.harness_authorized(request):
        return unauthorized()
    return await sidecar.proxy.handle(request, COMPLETIONS, OpenAIFront(semconv.API_COMPLETIONS))


async def models(request: web.Request) -> web.StreamResponse:
    sidecar = sidecar_of(request)
    if not sidecar.harness_authorized(request):
        return unauthorized()
    try:
        upstream = sidecar.router.pick(sidecar.identity(request).rollout_id)
    except inputs.BadInput as exc:
        return bad_input(exc)
    except NoUpstream:
        return openai_error(502, "no upstream is configured", "upstream_unreachable")
    if upstream.litellm_model is not None:
        return json_reply(
            200, {"object": "list", "data": [{"id": upstream.litellm_model, "object": "model", "owned_by": "litellm"}]}
        )
    headers = {}
    auth = upstream_authorization(sidecar.config, request, upstream)
    if auth:
        headers["Authorization"] = auth
    try:
        async with sidecar.session.get(upstream.url + "/v1/models", headers=headers) as response:
            body = await response.read()
            return web.Response(
                status=response.status, body=body, headers={"Content-Type": response.headers.get("Content-Type", JSON)}
            )
    except (aiohttp.ClientError, TimeoutError) as exc:
        return openai_error(502, f"upstream {upstream.url} is unreachable ({exc})", "upstream_unreachable")


def translated(path: str) -> Any:
    """A handler for the adapter mounted at /v1{path}."""

    async def handler(request: web.Request) -> web.StreamResponse:
        sidecar = sidecar_of(request)
        try:
            adapter = await load_adapter(path)
        except (ImportError, AttributeError) as exc:
            return openai_error(501, f"/v1{path} is not available in this sidecar: {exc}", "not_implemented")
        try:
            raw = await read_body(request, sidecar.config.max_body_bytes, sidecar.config.body_timeout_s)
        except inputs.BodyRefused as exc:
            return json_reply(exc.status, adapter.error_body(exc.status, exc.message, "invalid_request_error"))
        try:
            original = msgspec.json.decode(raw)
            if not isinstance(original, dict):
                raise ProtocolError(400, "the request body must be a JSON object")
        except msgspec.DecodeError as exc:
            body = adapter.error_body(400, f"request body is not valid JSON: {exc}", "invalid_request_error")
            return json_reply(400, body)
        except RecursionError:
            return json_reply(400, adapter.error_body(400, DEEP_JSON, "invalid_request_error"))
        except ProtocolError as exc:
            return _protocol_error(adapter, exc)
        if not sidecar.harness_authorized(request):
            return json_reply(401, adapter.error_body(401, "missing or wrong API key", "authentication_error"))
        try:
            translation = adapter.to_chat_request(original)
            sidecar.identity(request)  # ids a span cannot carry: refused here, in this protocol's shape
            while translation.step is not None:  # engine work the adapter needs first (base.Step)
                translation = translation.step.resume(await run_step(sidecar, request, translation.step))
        except ProtocolError as exc:
            return _protocol_error(adapter, exc)
        except inputs.BadInput as exc:  # 403: a per-rollout key used for another rollout
            kind = "permission_error" if exc.status == 403 else "invalid_request_error"
            return json_reply(exc.status, adapter.error_body(exc.status, exc.message, kind))
        except RecursionError:
            return json_reply(400, adapter.error_body(400, DEEP_JSON, "invalid_request_error"))
        if translation.reply is not None:  # the adapter's whole answer: no engine call
            body, content_type = translation.reply
            return web.Response(status=200, body=body, headers={"Content-Type": content_type})
        chat_bytes = msgspec.json.encode(translation.chat)
        if adapter.tokenize_only:
            return await _tokenize(sidecar, request, adapter, original, chat_bytes)
        front = AdapterFront(adapter, translation.respond_to or original, translation)
        try:
            return await sidecar.proxy.handle(request, CHAT, front, chat_bytes)
        except ProtocolError as exc:
            return _protocol_error(adapter, exc)

    return handler


def _protocol_error(adapter: Any, exc: ProtocolError) -> web.Response:
    """`exc` in the adapter's error shape; the field at fault goes only to adapters that take it (an
    adapter registered before `param` existed has the four-argument error_body)."""
    if exc.param is None:
        return json_reply(exc.status, adapter.error_body(exc.status, exc.message, exc.error_type))
    return json_reply(exc.status, adapter.error_body(exc.status, exc.message, exc.error_type, exc.param))


async def _tokenize(sidecar: Sidecar, request: web.Request, adapter: Any, original: dict[str, Any], chat_bytes: bytes) -> web.Response:
    try:
        status, body = await engine_tokenize(sidecar, request, chat_bytes)
    except ProtocolError as exc:
        return _protocol_error(adapter, exc)
    if status != 200:
        return json_reply(status, adapter.error_body(status, body.decode(errors="replace"), "api_error"))
    try:
        answer = msgspec.json.decode(body)
        if not isinstance(answer, dict):  # `null`, a list: the adapter reads keys (was a 500)
            raise msgspec.ValidationError(f"expected a JSON object, got {type(answer).__name__}")
        return json_reply(200, adapter.from_chat_response(answer, original))
    except ProtocolError as exc:
        return _protocol_error(adapter, exc)
    except (msgspec.MsgspecError, RecursionError) as exc:
        return json_reply(502, adapter.error_body(502, f"upstream /tokenize answered an unreadable body: {exc}", "api_error"))
