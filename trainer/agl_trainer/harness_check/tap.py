"""A recording proxy between the harness and the sidecar: what the harness asked and what it got.

A span records a call the sidecar made; a request the sidecar refused (a 400 naming a field) or a
path it does not serve has none. The tap sees both: each request's method, path and features, the
status the harness got, the time it went through, and the body of any answer of 400 or more. It
passes bytes through as they come (a stream chunk by chunk, compressed bodies as they are, hop-by-hop
headers dropped as a proxy must) and relays a WebSocket upgrade message by message, so the harness
talks to the sidecar as it would without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from agl_trainer.background_loop import AppServer
from agl_trainer.harness_check import features

ERROR_BODY_CHARS = 4000  # of a 4xx/5xx answer, kept for the report
_READ_JSON_BYTES = 64 * 1024**2  # a larger request body is passed on unread
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "trailers", "transfer-encoding", "upgrade", "host", "content-length"})  # fmt: skip
_WS_HANDSHAKE = frozenset({"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                           "sec-websocket-accept", "sec-websocket-protocol"})  # fmt: skip


class Exchange(msgspec.Struct):
    """One request the harness made, and its answer. `status` 0: none came (the harness left, or the
    sidecar did not answer: `error` says which)."""

    method: str
    path: str
    start_ns: int
    end_ns: int = 0
    status: int = 0
    model: str | None = None
    stream: bool = False
    websocket: bool = False
    messages: int = 0  # WebSocket messages the harness sent
    features: list[str] = []
    error: str | None = None  # the body of an answer >= 400 (cut), or what went wrong on the way


class Tap(AppServer):
    """The proxy on 127.0.0.1:<free port> in a thread: `start()`, `url`, `exchanges`, `stop()`."""

    def __init__(self, upstream: str) -> None:
        super().__init__("agl-harness-tap", self._app)
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._session: aiohttp.ClientSession | None = None

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=1024**3)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        # No timeout of its own (the check's --timeout-s bounds the harness); bodies as they are.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)

    async def _close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        exchange = Exchange(request.method, request.path_qs, time.time_ns())
        self.exchanges.append(exchange)
        try:
            if request.headers.get("upgrade", "").lower() == "websocket":
                return await self._websocket(request, exchange)
            return await self._http(request, exchange)
        except (ConnectionResetError, asyncio.CancelledError):
            exchange.error = exchange.error or "the harness closed the connection before the answer ended"
            raise
        finally:
            exchange.end_ns = time.time_ns()

    def settled(self, timeout_s: float = 10.0) -> list[Exchange]:
        """The exchanges once each has ended (its handler finished), or as they are after `timeout_s`:
        a harness may read its answer's last byte and exit before the tap's handler returns."""
        deadline = time.monotonic() + timeout_s
        while any(exchange.end_ns == 0 for exchange in self.exchanges) and time.monotonic() < deadline:
            time.sleep(0.01)
        return list(self.exchanges)

    def _headers(self, request: web.Request, drop: frozenset[str] = frozenset()) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP and k.lower() not in drop}

    async def _http(self, request: web.Request, exchange: Exchange) -> web.StreamResponse:
        assert self._session is not None
        body = await request.read()
        _describe(exchange, request.path, body)
        headers = self._headers(request)
        # aiohttp adds these when absent; the sidecar must see only what the harness sent
        skip = [name for name in ("Accept", "Accept-Encoding", "User-Agent", "Content-Type") if name not in request.headers]
        try:
            upstream = await self._session.request(
                request.method, self.upstream + request.path_qs, data=body, headers=headers,
                skip_auto_headers=skip, allow_redirects=False,
            )  # fmt: skip
        except (aiohttp.ClientError, OSError) as error:
            return _failed(exchange, 502, f"the sidecar did not answer ({type(error).__name__}: {error})")
        async with upstream:
            exchange.status = upstream.status
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    response.headers.add(name, value)
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            kept = bytearray()
            async for chunk in upstream.content.iter_any():
                if upstream.status >= 400 and len(kept) < ERROR_BODY_CHARS:
                    kept += chunk
                await response.write(chunk)
            await response.write_eof()
        if upstream.status >= 400:
            exchange.error = kept.decode("utf-8", "replace")[:ERROR_BODY_CHARS]
        return response

    async def _websocket(self, request: web.Request, exchange: Exchange) -> web.StreamResponse:
        assert self._session is not None
        exchange.websocket = True
        exchange.features = features.ordered(features.of_request(request.path, None, websocket=True))
        offered = [p.strip() for p in request.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        try:
            upstream = await self._session.ws_connect(
                self.upstream + request.path_qs, headers=self._headers(request, _WS_HANDSHAKE), protocols=offered,
                max_msg_size=0,
            )  # fmt: skip
        except aiohttp.WSServerHandshakeError as error:
            return _failed(exchange, error.status, f"the sidecar refused the WebSocket upgrade: HTTP {error.status} {error.message}")
        except (aiohttp.ClientError, OSError) as error:
            return _failed(exchange, 502, f"the sidecar did not answer ({type(error).__name__}: {error})")
        harness = web.WebSocketResponse(protocols=[upstream.protocol] if upstream.protocol else (), max_msg_size=0)
        await harness.prepare(request)
        exchange.status = 101

        async def relay(source: Any, target: Any, from_harness: bool) -> None:
            async for message in source:
                if message.type == aiohttp.WSMsgType.TEXT:
                    if from_harness:
                        exchange.messages += 1
                        _describe(exchange, request.path, message.data.encode(), websocket=True)
                    await target.send_str(message.data)
                elif message.type == aiohttp.WSMsgType.BINARY:
                    await target.send_bytes(message.data)
                else:
                    break
            await target.close()

        async with upstream:
            tasks = [asyncio.ensure_future(relay(harness, upstream, True)), asyncio.ensure_future(relay(upstream, harness, False))]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
        return harness


def _failed(exchange: Exchange, status: int, why: str) -> web.Response:
    """No answer from the sidecar to pass on: the harness gets `status` and `why` (the report too)."""
    exchange.status, exchange.error = status, why
    return web.json_response({"error": {"message": why, "type": "harness_check"}}, status=status)


def _describe(exchange: Exchange, path: str, body: bytes, websocket: bool = False) -> None:
    """The request's model, stream flag and features, when its body is a JSON object."""
    decoded: Any = None
    if body[:1] in (b"{", b" ", b"\n") and len(body) <= _READ_JSON_BYTES:
        with contextlib.suppress(msgspec.DecodeError, RecursionError):
            decoded = msgspec.json.decode(body)
    if isinstance(decoded, dict):
        if isinstance(decoded.get("model"), str):
            exchange.model = decoded["model"]
        exchange.stream = exchange.stream or decoded.get("stream") is True
    found = set(exchange.features) | features.of_request(path, decoded, websocket)
    exchange.features = features.ordered(found)
