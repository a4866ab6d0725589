"""What every route shares: the sidecar of a request, JSON and OpenAI-shaped replies, body decoding."""

from __future__ import annotations

import re
from typing import Any

import msgspec
from aiohttp import web

from agl_sidecar import inputs
from agl_sidecar.calls import wire
from agl_sidecar.proxy.fronts import JSON
from agl_sidecar.proxy.request import DEEP_JSON
from agl_sidecar.sidecar import SIDECAR_KEY, Sidecar


def sidecar_of(request: web.Request) -> Sidecar:
    return request.app[SIDECAR_KEY]


def json_reply(status: int, body: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(body), content_type=JSON, headers=headers)


def openai_error(status: int, message: str, error_type: str = "invalid_request_error", param: str | None = None) -> web.Response:
    return web.Response(status=status, body=wire.error_body(message, error_type, param, status), content_type=JSON)


def bad_input(exc: inputs.BadInput | inputs.BodyRefused) -> web.Response:
    if isinstance(exc, inputs.BodyRefused):
        return openai_error(exc.status, exc.message, "timeout" if exc.status == 408 else "invalid_request_error")
    error_type = "permission_error" if exc.status == 403 else "invalid_request_error"
    return openai_error(exc.status, exc.message, error_type, param=exc.param)


def unauthorized() -> web.Response:
    return openai_error(
        401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the sidecar's --api-key",
        "authentication_error",
    )


class BodyError(ValueError):
    """A body that does not decode as `kind`; `param` names the top-level field at fault, if one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = re.split(r"[.\[]", param, maxsplit=1)[0] if param else None


def decode_body(raw: bytes, kind: type, what: str) -> Any:
    try:
        return msgspec.json.decode(raw or b"{}", type=kind)
    except msgspec.ValidationError as exc:  # it may quote the refused value: never echoed at length
        raise BodyError(f"{what}: {inputs.shown_message(str(exc))}", wire.error_param(exc)) from None
    except msgspec.DecodeError as exc:
        raise BodyError(f"{what}: the body is not valid JSON ({inputs.shown_message(str(exc))})") from None
    except RecursionError:
        raise BodyError(f"{what}: {DEEP_JSON}") from None


ROUTE_SHAPES = (
    "POST [/rollouts/{id}[/attempts/{n}][/modes/{train|val}]]/v1/chat/completions (also /v1/completions, "
    "/v1/messages, /v1/responses; GET .../v1/models), POST /rollouts/{id}/reward and /end, /agl/v1/... (admin)"
)


async def no_route(request: web.Request) -> web.Response:
    """Any method and path no route serves (mounted last, so it costs matched calls nothing): an
    OpenAI-shaped JSON 404 naming what was asked and what the sidecar serves, not aiohttp's plain
    "404: Not Found" (a harness with a wrong base URL, an empty rollout id, a trailing slash)."""
    shown = inputs.shown_text(request.method + " " + request.rel_url.raw_path)
    for method in ("POST", "GET"):  # the path is served, with another method: a 405 saying which
        if method != request.method:
            match = await request.app.router.resolve(request.clone(method=method))
            if match.handler is not no_route:
                response = openai_error(405, f"{shown}: this path takes {method}", "method_not_allowed")
                response.headers["Allow"] = method
                return response
    return openai_error(404, f"the sidecar has no route for {shown}; it serves {ROUTE_SHAPES}", "not_found")
