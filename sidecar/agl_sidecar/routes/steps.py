"""Engine work a protocol adapter asks for before its call (protocols/base.Step): a prompt's tokens
counted by the engine's own tokenizer and chat template, or a summary asked of the policy.

A summary goes through this sidecar's own chat route, under the harness's request's rollout prefix
and headers (its rollout, agents and key) plus `x-agl-compaction: 1`: it is then a call like any
other, held while training pauses, recorded with its own span and token IDs, and declared a
compaction, so the summary is the policy's and is trained. Its span's agl.call.api is
`openai.chat_completions` (the sidecar spoke chat to itself)."""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from agl import semconv
from agl_sidecar.protocols.base import STEP_COUNT, STEP_SUMMARIZE, ProtocolError, Step
from agl_sidecar.proxy.request import upstream_authorization
from agl_sidecar.proxy.routing import NoUpstream
from agl_sidecar.sidecar import Sidecar

# Hop-by-hop and body headers are the new request's own; the rest (rollout, agents, key, trace) travel.
_NOT_FORWARDED = frozenset({"host", "content-length", "content-type", "transfer-encoding", "connection",
                            "accept-encoding", "keep-alive", "expect", semconv.HEADER_COMPACTION})  # fmt: skip


async def run_step(sidecar: Sidecar, request: web.Request, step: Step) -> Any:
    """The step's result for its `resume`; ProtocolError when the engine could not do it."""
    if step.kind == STEP_COUNT:
        status, body = await engine_tokenize(sidecar, request, msgspec.json.encode(step.chat))
        if status != 200:
            raise ProtocolError(502, f"the engine could not count the prompt's tokens ({status}): {body[:300]!r}", "api_error")
        answer = _json_object(body, "/tokenize")
        count = answer.get("count")
        tokens = answer.get("tokens")
        if isinstance(count, int):
            return count
        if isinstance(tokens, list):
            return len(tokens)
        raise ProtocolError(502, "the engine's /tokenize answer has neither `count` nor `tokens`", "api_error")
    if step.kind == STEP_SUMMARIZE:
        return await summarize(sidecar, request, step.chat)
    raise ProtocolError(500, f"an adapter asked for a step the sidecar does not know: {step.kind!r}", "api_error")


async def engine_tokenize(sidecar: Sidecar, request: web.Request, chat_bytes: bytes) -> tuple[int, bytes]:
    """The engine's POST /tokenize answer (status, body) for a chat request's bytes."""
    try:
        upstream = sidecar.router.pick(sidecar.identity(request).rollout_id)
    except NoUpstream:
        raise ProtocolError(502, "no upstream is configured", "api_error") from None
    headers = {"Content-Type": "application/json"}
    auth = upstream_authorization(sidecar.config, request, upstream)
    if auth:
        headers["Authorization"] = auth
    try:
        async with sidecar.session.post(upstream.url + "/tokenize", data=chat_bytes, headers=headers) as response:
            return response.status, await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ProtocolError(502, f"upstream {upstream.url} is unreachable ({exc})", "api_error") from None


async def summarize(sidecar: Sidecar, request: web.Request, chat: dict[str, Any]) -> dict[str, Any]:
    """The policy's chat.completion for `chat`, asked through this sidecar's chat route."""
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    if not sockname:
        raise ProtocolError(500, "the sidecar cannot tell its own address to ask for a summary", "api_error")
    host, port = sockname[0], sockname[1]
    host = f"[{host}]" if ":" in host else host
    path = request.rel_url.raw_path
    prefix = path[: path.rfind("/v1/")]  # the rollout prefix the harness called under, if any
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
    headers[semconv.HEADER_COMPACTION] = "1"
    headers["Content-Type"] = "application/json"
    url = f"{request.scheme}://{host}:{port}{prefix}/v1/chat/completions"
    body = msgspec.json.encode({**chat, "stream": False})
    try:
        async with sidecar.session.post(url, data=body, headers=headers, ssl=False) as response:
            status, answer = response.status, await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ProtocolError(502, f"the summary call failed: {exc}", "api_error") from None
    if status != 200:
        raise ProtocolError(status if status >= 500 else 502, f"the summary call failed ({status}): {answer[:300]!r}", "api_error")
    return _json_object(answer, "the summary call")


def _json_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        answer = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(502, f"{what} answered an unreadable body: {exc}", "api_error") from None
    if not isinstance(answer, dict):
        raise ProtocolError(502, f"{what} answered {type(answer).__name__}, not a JSON object", "api_error")
    return answer
