"""The harness's request: typed once (msgspec, only the fields the sidecar reads) and forwarded as
bytes with `return_token_ids` / logprobs appended when the harness did not ask for them."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from agl import semconv
from agl_sidecar import inputs
from agl_sidecar.calls import wire
from agl_sidecar.calls.attribution import Identity, resolve
from agl_sidecar.config import SidecarConfig
from agl_sidecar.proxy.routing import Upstream

CHAT = "chat"
COMPLETIONS = "completions"
UPSTREAM_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
OPERATIONS = {CHAT: semconv.OPERATION_CHAT, COMPLETIONS: semconv.OPERATION_TEXT_COMPLETION}


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
        return _raise(f"invalid request body: {inputs.shown_message(text)}", param)  # never echoed at length
    except msgspec.DecodeError as exc:
        if not body.strip():
            return _raise("empty request body: send a JSON object", None)
        return _raise(f"request body is not valid JSON: {inputs.shown_message(str(exc))}", None)
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


def call_seed(base: int, identity: Any, body: bytes) -> int:
    """The engine seed of one call when the sidecar's sampling_seed is set: a hash of that seed, the
    rollout, its attempt and the request's bytes. A harness that sends the same calls gets the same
    seeds in every run whatever the calls' order or timing; k attempts of a task (other rollout ids)
    sample differently. In [0, 2^31) so every engine takes it."""
    import hashlib

    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{base}\0{identity.rollout_id}\0{identity.attempt}\0".encode())
    digest.update(body)
    return int.from_bytes(digest.digest(), "big") % (2**31)


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

async def read_body(request: web.Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The request body, or inputs.TooLarge past `limit` bytes: a declared length over it is refused
    before a byte is read, an undeclared one (chunked) as soon as it passes it, and a compressed one
    as soon as its inflated bytes pass it (aiohttp inflates in 64 KiB steps as it is read; its own
    read() raises the step to the whole limit, and kept several limits' worth per request).
    inputs.BodyTimeout when the body is not whole within `timeout_s` (the connection is then closed)."""
    declared = request.content_length
    encoding = request.headers.get("Content-Encoding")
    if declared is not None and declared > limit:
        raise inputs.TooLarge(limit)
    if request.content.is_eof() and (not encoding or encoding.strip().lower() == "identity"):
        try:  # the whole body arrived with the headers (the usual case): no wait, so no timer
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise inputs.TooLarge(limit) from None
    try:
        async with asyncio.timeout(timeout_s):
            if not encoding or encoding.strip().lower() == "identity":
                try:
                    return await request.read()
                except web.HTTPRequestEntityTooLarge:
                    raise inputs.TooLarge(limit) from None
            body = bytearray()
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > limit:
                    raise inputs.TooLarge(limit, encoding.strip())
            return bytes(body)
    except TimeoutError:
        request.protocol.close()  # answer, then close: the rest of the body is not waited for
        raise inputs.BodyTimeout(timeout_s or 0) from None


def identity_from(request: web.Request, api_key_rollouts: dict[str, str]) -> Identity:
    info = request.match_info
    identity = resolve(request.headers, info.get("rollout_id"), info.get("attempt"), api_key_rollouts)
    path_mode = info.get("mode")
    if path_mode is not None:  # /rollouts/{id}[/attempts/{n}]/modes/{mode}: the URL's mode wins
        if path_mode not in semconv.MODES:
            raise inputs.BadInput(
                f"mode {inputs.shown_text(path_mode)} in the URL path is not one of {list(semconv.MODES)}",
                "mode in the URL path",
            )
        identity.mode = path_mode
    return identity


def upstream_authorization(config: SidecarConfig, request: web.Request, upstream: Upstream) -> str | None:
    """The Authorization the engine gets: --upstream-api-key, else the credentials in the
    upstream's URL (as Basic auth), else the harness's own header when the sidecar has no key."""
    if config.upstream_api_key:
        return f"Bearer {config.upstream_api_key}"
    if upstream.authorization is not None:
        return upstream.authorization
    # A sidecar with its own API key does not pass the harness's key on.
    if config.api_key or config.rollout_api_keys:
        return None
    given = request.headers.get("Authorization")
    # A header that arrived with bytes outside latin-1 cannot be sent on as it came.
    return given if given is None or _latin1(given) else None


def _latin1(value: str) -> bool:
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True
