"""The tap between the harness and the sidecar: bytes pass as they come (a compressed body untouched,
a stream event by event, a WebSocket message by message), and each request's path, status, features
and the body of a refusal are kept."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
from collections.abc import Iterator
from urllib.parse import urlsplit

import aiohttp
import httpx
import pytest
from aiohttp import web

from agl_trainer.background_loop import BackgroundLoop
from agl_trainer.harness_check.tap import ERROR_BODY_CHARS, Tap

PACKED = gzip.compress(b'{"answer": "packed"}')


class Upstream:
    """A stand-in sidecar: what the tap must pass through unchanged."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self.loop = BackgroundLoop("test-upstream")
        self.url = ""
        self.release = asyncio.Event()

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/rollouts/r1/v1/messages", self.packed)
        app.router.add_post("/rollouts/r1/v1/chat/completions", self.stream)
        app.router.add_post("/rollouts/r1/v1/responses", self.refuse)
        app.router.add_get("/rollouts/r1/v1/responses", self.socket)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def packed(self, request: web.Request) -> web.Response:
        self.seen.append(dict(request.headers))
        assert await request.read() == b'{"model": "m", "stream": false}'
        return web.Response(body=PACKED, headers={"content-encoding": "gzip", "content-type": "application/json"})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(dict(request.headers))
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: first\n\n")
        await self.release.wait()  # the harness must see the first event before the second exists
        await response.write(b"data: second\n\n")
        await response.write_eof()
        return response

    async def refuse(self, request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "x" * (ERROR_BODY_CHARS * 2)}}, status=400)

    async def socket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=["agl.v1"])
        await ws.prepare(request)
        async for message in ws:
            await ws.send_str("echo:" + message.data)
        return ws


@pytest.fixture
def tapped() -> Iterator[tuple[Upstream, Tap]]:
    upstream = Upstream()
    upstream.loop.start(upstream.start, lambda: upstream.runner.cleanup(), timeout_s=10)
    tap = Tap(upstream.url).start()
    try:
        yield upstream, tap
    finally:
        tap.stop()
        upstream.loop.stop()


def test_a_compressed_answer_passes_untouched_and_headers_as_the_harness_sent_them(tapped):
    upstream, tap = tapped
    # http.client sends only what it is given (no User-Agent, no Accept): the tap must add none either
    connection = http.client.HTTPConnection(urlsplit(tap.url).hostname, urlsplit(tap.url).port, timeout=30)
    connection.request("POST", "/rollouts/r1/v1/messages", body=b'{"model": "m", "stream": false}',
                       headers={"x-api-key": "k", "Content-Type": "application/json"})  # fmt: skip
    raw = connection.getresponse()
    assert raw.status == 200 and raw.getheader("content-encoding") == "gzip"
    assert raw.read() == PACKED  # the upstream's bytes, not decompressed on the way
    connection.close()
    [headers] = upstream.seen
    assert headers["x-api-key"] == "k" and headers["Accept-Encoding"] == "identity"  # http.client's own
    assert "User-Agent" not in headers and "Accept" not in headers
    assert headers["Host"] == urlsplit(upstream.url).netloc  # the sidecar's, not the tap's
    [exchange] = tap.settled()
    assert (exchange.method, exchange.path, exchange.status, exchange.model, exchange.stream) == (
        "POST", "/rollouts/r1/v1/messages", 200, "m", False
    )
    assert exchange.error is None and exchange.end_ns >= exchange.start_ns


def test_a_stream_reaches_the_harness_event_by_event(tapped):
    upstream, tap = tapped
    body = {"model": "m", "stream": True, "tools": [{"type": "function"}],
            "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "out"}]}  # fmt: skip
    with httpx.stream("POST", tap.url + "/rollouts/r1/v1/chat/completions", json=body, timeout=30) as reply:
        lines = reply.iter_lines()
        assert next(lines) == "data: first"  # arrived while the upstream still holds the second
        upstream.loop.loop.call_soon_threadsafe(upstream.release.set)  # type: ignore[union-attr]
        assert [line for line in lines if line] == ["data: second"]
    [exchange] = tap.settled()
    assert exchange.status == 200 and exchange.stream is True
    assert exchange.features == ["streaming", "tools", "tool results"]


def test_a_refusal_keeps_its_status_and_the_start_of_its_body(tapped):
    _, tap = tapped
    reply = httpx.post(tap.url + "/rollouts/r1/v1/responses", json={"model": "m", "input": "hi"})
    assert reply.status_code == 400 and len(reply.content) > ERROR_BODY_CHARS * 2  # the whole body for the harness
    [exchange] = tap.settled()
    assert exchange.status == 400 and exchange.error is not None
    assert exchange.error.startswith('{"error": {"message": "xxx') and len(exchange.error) == ERROR_BODY_CHARS


def test_a_websocket_is_relayed_both_ways(tapped):
    _, tap = tapped

    async def talk() -> list[str]:
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(tap.url + "/rollouts/r1/v1/responses", protocols=["agl.v1"]) as ws:
                assert ws.protocol == "agl.v1"
                answers = []
                for text in (json.dumps({"type": "response.create", "model": "m", "stream": True}), "two"):
                    await ws.send_str(text)
                    answers.append((await ws.receive()).data)
                return answers

    answers = asyncio.run(talk())
    assert answers[1] == "echo:two" and answers[0].startswith("echo:{")
    [exchange] = tap.settled()
    assert (exchange.websocket, exchange.status, exchange.messages, exchange.model) == (True, 101, 2, "m")
    assert exchange.features == ["streaming", "websocket"]


def test_an_upstream_that_does_not_answer_is_a_502_the_report_explains():
    tap = Tap("http://127.0.0.1:9").start()  # nothing listens on the discard port
    try:
        reply = httpx.post(tap.url + "/v1/chat/completions", json={"model": "m"})
    finally:
        tap.stop()
    assert reply.status_code == 502
    [exchange] = tap.settled()
    assert exchange.status == 502 and exchange.error.startswith("the sidecar did not answer")
