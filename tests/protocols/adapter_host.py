"""A minimal HTTP host for the protocol adapters, so the official SDK clients can be run against them
over real loopback HTTP before (and independently of) the sidecar app.

It does what the seam in agl_sidecar/protocols/base.py says the sidecar core does, and nothing
more: translate the request, send it to the engine (a FakeVLLM URL, or a callable returning a chat
response or a list of chunks, for shapes the fake does not produce such as tool calls), hand the
response or each parsed chunk to the adapter, answer errors in the adapter's format.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any, Self

import aiohttp
from agl_sidecar.protocols.base import ProtocolError
from agl_sidecar.protocols.registry import ADAPTERS, adapter_for
from aiohttp import web

Engine = Callable[[dict[str, Any]], "dict[str, Any] | list[dict[str, Any]]"]


class AdapterHost:
    def __init__(self, engine: str | Engine) -> None:
        self.engine = engine
        self.chat_requests: list[dict[str, Any]] = []
        self.seen: list[tuple[str, dict[str, str]]] = []  # (path, headers) of every request
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        ready = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._stop())
            self._loop.close()

        self._thread = threading.Thread(target=serve, name="adapter-host", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("adapter host did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        app = web.Application()
        for path in ADAPTERS:
            app.router.add_post(f"/v1{path}", self._handle)
            app.router.add_post(f"/rollouts/{{rollout}}/v1{path}", self._handle)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/rollouts/{rollout}/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._session = aiohttp.ClientSession()

    async def _stop(self) -> None:
        assert self._runner is not None and self._session is not None
        await self._session.close()
        await self._runner.cleanup()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        """Chat completions pass through unchanged (for harnesses that speak chat)."""
        self.seen.append((request.path, dict(request.headers)))
        chat = json.loads(await request.read())
        self.chat_requests.append(chat)
        if not chat.get("stream"):
            return web.json_response(await self._post("/v1/chat/completions", chat))
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        async for chunk in self._chunks(chat):
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((request.path, dict(request.headers)))
        path = request.path[request.path.index("/v1/") + 3 :]
        adapter = adapter_for(path)
        try:
            try:
                body = json.loads(await request.read())
            except ValueError as exc:
                raise ProtocolError(400, f"request body is not valid JSON: {exc}") from None
            chat = adapter.to_chat_request(body).chat
            self.chat_requests.append(chat)
            if adapter.tokenize_only:
                return web.json_response(
                    adapter.from_chat_response(await self._post("/tokenize", chat), body)
                )
            if not chat.get("stream"):
                return web.json_response(
                    adapter.from_chat_response(await self._post("/v1/chat/completions", chat), body)
                )
            translator = adapter.stream_translator(body)
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            async for chunk in self._chunks(chat):
                for event in translator.feed(chunk):
                    await response.write(event)
            for event in translator.finish():
                await response.write(event)
            await response.write_eof()
            return response
        except ProtocolError as exc:
            return web.json_response(
                adapter.error_body(exc.status, exc.message, exc.error_type), status=exc.status
            )

    async def _post(self, path: str, chat: dict[str, Any]) -> dict[str, Any]:
        if callable(self.engine):
            answer = self.engine(chat)
            assert isinstance(answer, dict)
            return answer
        assert self._session is not None
        async with self._session.post(self.engine + path, json=chat) as reply:
            data = await reply.json()
            if reply.status != 200:
                raise ProtocolError(reply.status, data["error"]["message"], data["error"]["type"])
            return data

    async def _chunks(self, chat: dict[str, Any]) -> Any:
        if callable(self.engine):
            for chunk in self.engine(chat):
                yield chunk
            return
        assert self._session is not None
        async with self._session.post(self.engine + "/v1/chat/completions", json=chat) as reply:
            async for line in reply.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    yield json.loads(line[6:])
