"""What every route shares: the sidecar of a request, JSON and OpenAI-shaped replies, body decoding."""

from __future__ import annotations

import re
from typing import Any

import msgspec
from aiohttp import web

from agl_sidecar.proxy import inputs, wire
from agl_sidecar.proxy.fronts import JSON
from agl_sidecar.proxy.request import DEEP_JSON
from agl_sidecar.sidecar import SIDECAR_KEY, Sidecar


def sidecar_of(request: web.Request) -> Sidecar:
    return request.app[SIDECAR_KEY]


def json_reply(status: int, body: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(body), content_type=JSON, headers=headers)


def openai_error(status: int, message: str, error_type: str = "invalid_request_error", param: str | None = None) -> web.Response:
    return web.Response(status=status, body=wire.error_body(message, error_type, param, status), content_type=JSON)


def bad_input(exc: inputs.BadInput | inputs.TooLarge) -> web.Response:
    if isinstance(exc, inputs.TooLarge):
        return openai_error(413, exc.message)
    return openai_error(400, exc.message, param=exc.param)


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
    except msgspec.ValidationError as exc:
        raise BodyError(f"{what}: {exc}", wire.error_param(exc)) from None
    except msgspec.DecodeError as exc:
        raise BodyError(f"{what}: the body is not valid JSON ({exc})") from None
    except RecursionError:
        raise BodyError(f"{what}: {DEEP_JSON}") from None
