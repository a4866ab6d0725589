"""The sidecar's client to its engines (proxy/engine_client.py), against real servers on loopback:
a scripted raw socket server for the byte-level cases (how an answer is framed, closes, breaks,
lies), aiohttp for an ordinary engine, and aiohttp over TLS for the https:// path."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Self

import pytest
from agl_sidecar.proxy.engine_client import (
    HIGH_WATER,
    MAX_HEAD_BYTES,
    EngineBrokeOff,
    EngineClient,
    EngineDisconnected,
    EngineResponse,
    EngineUnreachable,
    LocalResourcesExhausted,
    ResponseTooLarge,
)
from aiohttp import web

from tests.support.tls import self_signed

JSON = {"Content-Type": "application/json"}
Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body (by its Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


class RawEngine:
    """A TCP server whose every connection is handled by `serve` (connections counted), and an
    EngineClient to it, closed on the way out whatever the test asserted."""

    def __init__(self, serve: Serve, timeout_s: float | None = None) -> None:
        self.serve = serve
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.url = ""
        self.client = EngineClient(timeout_s=timeout_s)

    async def __aenter__(self) -> Self:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.serve(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
                pass  # the client left, or the test ended
            finally:
                writer.close()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        assert self.server is not None
        self.server.close()

    async def post(
        self, path: str = "/v1/chat/completions", body: bytes = b"{}", headers: dict[str, str] = JSON
    ) -> EngineResponse:
        return await self.client.post(self.url, path, body, headers)


def answer(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body), extra, body
    )


async def test_a_content_length_answer_is_read_whole_and_the_connection_reused() -> None:
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(reader)
            heads.append(head)
            writer.write(answer(b'{"echo":' + body + b"}"))

    async with RawEngine(serve) as engine:
        for i in range(3):
            response = await engine.post("/v1/chat/completions", b'{"n":%d}' % i, JSON)
            assert response.status == 200
            assert response.headers["content-type"] == "application/json"
            assert response.content_length == len(b'{"echo":{"n":0}}')
            assert await response.read(1 << 20) == b'{"echo":{"n":%d}}' % i
            response.close()
    assert engine.connections == 1 and engine.client.connections_made == 1
    request_line, *header_lines = heads[0].split(b"\r\n")
    assert request_line == b"POST /v1/chat/completions HTTP/1.1"
    sent = {line.split(b": ")[0].lower(): line.split(b": ", 1)[1] for line in header_lines if line}
    assert sent[b"host"] == engine.url.split("//")[1].encode()
    assert sent[b"accept-encoding"] == b"identity"  # the answer is read, so never compressed
    assert sent[b"content-length"] == b"7" and sent[b"content-type"] == b"application/json"


async def test_a_chunked_stream_arrives_as_it_is_sent_and_ends_the_message() -> None:
    second_chunk = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"d\r\ndata: first\n\n\r\n")
        await second_chunk.wait()  # nothing more until the client has read the first event
        writer.write(b"e\r\ndata: second\n\n\r\n0\r\n\r\n")
        await reader.read()  # keep the connection: the message's end is the terminator, not a close

    async with RawEngine(serve) as engine:
        response = await engine.post()
        assert await response.readany() == b"data: first\n\n"
        second_chunk.set()
        assert await response.readany() == b"data: second\n\n"
        assert await response.readany() == b""
        assert engine.client._idle  # the terminated message handed its connection back for reuse


async def test_an_answer_delimited_by_the_close_is_complete_and_not_reused() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + b"x" * 70_000)
        await writer.drain()

    async with RawEngine(serve) as engine:
        for _ in range(2):
            response = await engine.post()
            assert response.content_length is None
            assert await response.read(1 << 20) == b"x" * 70_000
    assert engine.connections == 2


async def test_connection_close_and_http_1_0_answers_are_not_pooled() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b"{}").replace(b"HTTP/1.1", b"HTTP/1.0"))
        await reader.read()

    async with RawEngine(serve) as engine:
        for _ in range(2):
            response = await engine.post()
            assert await response.read(100) == b"{}"
    assert engine.connections == 2


async def test_an_interim_100_continue_is_skipped() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + answer(b'{"ok":1}'))
        await reader.read()

    async with RawEngine(serve) as engine:
        response = await engine.post()
        assert response.status == 200 and await response.read(100) == b'{"ok":1}'


async def test_a_refused_port_is_unreachable() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    client = EngineClient(timeout_s=None)
    with pytest.raises(EngineUnreachable, match=f"127.0.0.1:{port}"):
        await client.post(f"http://127.0.0.1:{port}", "/v1/chat/completions", b"{}", JSON)
    await client.close()


async def test_a_close_before_the_status_line_is_a_disconnect_the_proxy_may_resend() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)  # and close without answering

    async with RawEngine(serve) as engine:
        with pytest.raises(EngineDisconnected):
            await engine.post()


async def test_a_close_mid_body_breaks_the_answer_off() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 10)
        await writer.drain()

    async with RawEngine(serve) as engine:
        response = await engine.post()
        assert await response.readany() == b"x" * 10
        with pytest.raises(EngineBrokeOff, match="mid-answer"):
            await response.readany()
        response = await engine.post()
        with pytest.raises(EngineBrokeOff):
            await response.read(1000)


async def test_an_answer_that_is_not_http_is_refused() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhelloHTTP/9.9 nonsense\r\n\r\n")
        await reader.read()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")
        await reader.read()

    async with RawEngine(garbage) as engine:
        with pytest.raises(EngineBrokeOff, match="not valid HTTP"):
            await engine.post()
    async with RawEngine(serve) as engine:  # bytes after a complete answer that nobody asked for: never reused
        for _ in range(2):
            response = await engine.post()
            assert await response.read(100) == b"hello"
    assert engine.connections == 2


async def test_headers_past_the_limit_are_refused() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"x-filler: " + b"a" * 70_000 + b"\r\ncontent-length: 0\r\n\r\n")
        await reader.read()

    async with RawEngine(serve) as engine:
        with pytest.raises(EngineBrokeOff, match="headers are over"):
            await engine.post()


async def test_repeated_headers_are_joined_and_names_read_in_any_case() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b"{}", b"X-Thing: a\r\nx-THING: b\r\nCONTENT-TYPE: text/plain\r\n"))
        await reader.read()

    async with RawEngine(serve) as engine:
        response = await engine.post()
        assert response.headers["x-thing"] == "a, b"
        assert response.headers.get("content-type") == "application/json, text/plain"


async def test_the_timeout_covers_the_whole_answer() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()

    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n")
        await reader.read()

    for serve in (silent, stalls):
        async with RawEngine(serve, timeout_s=0.2) as engine:
            with pytest.raises(TimeoutError):
                response = await engine.post()
                assert await response.readany() == b"x"
                await response.readany()


async def test_an_unread_stream_pauses_the_engine_and_resumes_when_read() -> None:
    total = 16 * HIGH_WATER

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        for _ in range(total // 65536):
            writer.write(b"y" * 65536)
            await writer.drain()
        await reader.read()

    async with RawEngine(serve) as engine:
        response = await engine.post()

        async def paused() -> None:  # the engine sends all it can while nothing is read
            while not response._paused:  # type: ignore[attr-defined]
                await asyncio.sleep(0.005)

        await asyncio.wait_for(paused(), 30)
        await asyncio.sleep(0.05)  # what the engine still sends now piles up only if reading goes on
        assert response._size < 2 * HIGH_WATER  # type: ignore[attr-defined]
        received = 0
        while data := await response.readany():
            received += len(data)
        assert received == total


async def test_read_refuses_an_answer_over_its_limit() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            if b"/declared" in head:
                writer.write(answer(b"z" * 5000))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1388\r\n" + b"z" * 5000 + b"\r\n0\r\n\r\n")

    async with RawEngine(serve) as engine:
        for path in ("/declared", "/chunked"):
            response = await engine.post(path, b"{}", JSON)
            with pytest.raises(ResponseTooLarge):
                await response.read(4000)
            response.close()


async def test_leaving_before_the_answer_closes_the_connection() -> None:
    asked, closed = asyncio.Event(), asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        asked.set()
        await reader.read()  # until the client closes: what vLLM takes as an abort
        closed.set()

    async with RawEngine(serve) as engine:
        task = asyncio.create_task(engine.post())
        await asyncio.wait_for(asked.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(closed.wait(), 5)
        assert not engine.client._idle.get(("127.0.0.1", int(engine.url.rsplit(":", 1)[1])))


async def test_a_path_prefix_and_credentials_free_host_are_sent() -> None:
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        heads.append(head)
        writer.write(answer(b"{}"))
        await reader.read()

    async with RawEngine(serve) as engine:
        await (await engine.client.post(engine.url + "/engine/a", "/v1/completions", b"{}", {"Authorization": "Bearer k"})).read(10)
        with pytest.raises(ValueError, match="line break"):
            await engine.post("/v1/completions", b"{}", {"Authorization": "Bearer k\r\nX-Evil: 1"})
    assert heads[0].startswith(b"POST /engine/a/v1/completions HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer k\r\n" in heads[0]


async def test_an_https_engine_is_reached_through_aiohttp_with_the_same_interface(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path, "engine")
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    client_tls = ssl.create_default_context(cafile=str(cert))
    finish = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        assert request.headers["Accept-Encoding"] == "identity"
        if request.path.endswith("/broken"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            response.content_length = 100
            await response.prepare(request)
            await response.write(b"data: 1\n\n")
            await finish.wait()
            request.transport.close()  # type: ignore[union-attr]
            return response
        return web.Response(body=b'{"tls":true}' + await request.read(), content_type="application/json")

    app = web.Application()
    app.router.add_post("/{tail:.*}", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_tls)
    await site.start()
    port = runner.addresses[0][1]
    try:
        client = EngineClient(timeout_s=None, ssl_context=client_tls)
        response = await client.post(f"https://127.0.0.1:{port}", "/v1/chat/completions", b"!", JSON)
        assert response.status == 200 and response.headers.get("content-type") == "application/json"
        assert await response.read(100) == b'{"tls":true}!'
        with pytest.raises(ResponseTooLarge):
            await (await client.post(f"https://127.0.0.1:{port}", "/x", b"!" * 200, JSON)).read(100)
        stream = await client.post(f"https://127.0.0.1:{port}", "/broken", b"", JSON)
        assert await stream.readany() == b"data: 1\n\n"
        finish.set()
        with pytest.raises(EngineBrokeOff):
            await stream.readany()
        await client.close()
        plain = EngineClient(timeout_s=None)  # the system's trust store does not know this certificate
        with pytest.raises(EngineUnreachable):
            await plain.post(f"https://127.0.0.1:{port}", "/v1/chat/completions", b"!", JSON)
        await plain.close()
    finally:
        await runner.cleanup()


async def test_an_answer_before_the_whole_request_went_out_is_not_followed_on_its_connection() -> None:
    big = b"{" + b" " * (32 << 20) + b"}"  # more than the socket buffers hold while the engine reads none

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if b"/early" in head:  # answered from the head alone: the body is still on its way
            writer.write(answer(b'{"error":"too large"}'))
            await asyncio.sleep(3600)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(answer(b"{}"))
        await reader.read()

    async with RawEngine(serve, timeout_s=30) as engine:  # reusing the connection would wait on the first answer's
        response = await engine.post("/early", big, JSON)
        assert await response.read(100) == b'{"error":"too large"}'
        response = await engine.post()
        assert await response.read(100) == b"{}"
    assert engine.connections == 2


async def test_an_ipv6_literal_and_a_host_name_are_reached_with_their_host_header() -> None:
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        heads.append(head)
        writer.write(answer(b"{}"))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "::1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        client = EngineClient(timeout_s=None)
        response = await client.post(f"http://[::1]:{port}", "/v1/completions", b"{}", JSON)
        assert await response.read(10) == b"{}"
        await client.close()
    finally:
        server.close()
    assert f"\r\nHost: [::1]:{port}\r\n".encode() in heads[0]
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        client = EngineClient(timeout_s=None)
        response = await client.post(f"http://localhost:{port}", "/v1/completions", b"{}", JSON)
        assert await response.read(10) == b"{}"
        await client.close()
    finally:
        server.close()
    assert f"\r\nHost: localhost:{port}\r\n".encode() in heads[1]


def test_an_internationalized_host_and_path_are_sent_in_ascii() -> None:
    from agl_sidecar.proxy.engine_client import _Target

    target = _Target("http://bücher.example:8000/prefix ä/")
    assert target.key == ("bücher.example", 8000)  # getaddrinfo encodes the name itself
    assert target.host_header == b"xn--bcher-kva.example:8000"
    assert target.prefix == b"/prefix%20%C3%A4"
    plain = _Target("http://user:pw@10.0.0.1/v1%2Fx")
    assert (plain.key, plain.host_header, plain.prefix) == (("10.0.0.1", 80), b"10.0.0.1", b"/v1%2Fx")


# --- every byte an engine sends is bounded as it arrives ------------------------------------------

async def _endless(writer: asyncio.StreamWriter, piece: bytes, sent: list[int]) -> None:
    """Write `piece` over and over until the client goes away (counting what was written)."""
    while True:
        writer.write(piece)
        sent[0] += len(piece)
        await writer.drain()


@pytest.mark.parametrize(
    ("opening", "piece"),
    [
        (b"HTTP/1.1 200 OK\r\nx-filler: ", b"a" * 4096),  # a header value that never ends
        (b"HTTP/1.1 200 OK\r\n", b"b" * 4096),  # a header name that never ends
        (b"", b"HTTP/1.1 100 Continue\r\nx: y\r\n\r\n" * 64),  # interim answers without end
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n0\r\nx-trailer: ", b"t" * 4096),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5;ext=", b"e" * 4096),  # a chunk extension
    ],
    ids=["header-value", "header-name", "interim-answers", "trailer", "chunk-extension"],
)
async def test_an_answer_whose_framing_never_ends_is_cut_by_the_bound(opening: bytes, piece: bytes) -> None:
    # Before: the 64 KiB head limit was checked only when a header completed; httptools grew the
    # header by concatenation (a 64 MiB one cost +131 MB and seconds of CPU), and one that never
    # ended grew until the sidecar was killed (no upstream_timeout_s by default).
    sent = [0]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(opening)
        await _endless(writer, piece, sent)

    async with RawEngine(serve) as engine:
        async with asyncio.timeout(120):  # a guard: before the fix this never returned
            with pytest.raises(EngineBrokeOff, match="over"):
                response = await engine.post()
                while await response.readany():
                    pass
    assert sent[0] > MAX_HEAD_BYTES  # the engine did send past the bound


async def test_framing_in_proportion_to_the_body_is_taken() -> None:
    # A stream of one-byte chunks: its framing is five times its body, within the bound's allowance;
    # 2.4 MB arrive over many reads (at most 256 KiB each), so the bound is checked on the way.
    chunks = b"".join(b"1\r\n%c\r\n" % (97 + i % 26) for i in range(400_000))

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
        await reader.read()

    async with RawEngine(serve) as engine:
        response = await engine.post()
        assert len(await response.read(1 << 20)) == 400_000


async def test_a_close_delimited_body_cut_by_a_reset_is_broken_off() -> None:
    # Before: any end of a body delimited by the connection's close was taken as its end, a reset too.
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + b'{"choices": [')
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
        writer.transport.abort()

    async with RawEngine(serve) as engine:
        response = await engine.post()
        with pytest.raises(EngineBrokeOff, match="reset|mid-answer"):
            await response.read(1 << 20)


# --- local resource exhaustion is not the engine's fault --------------------------------------------

@contextlib.contextmanager
def descriptors_exhausted() -> Iterator[Callable[[], None]]:
    """No new file descriptor can be opened in this process (the soft RLIMIT_NOFILE below the
    descriptors open) until the yielded function is called, or the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)  # a new descriptor takes the lowest free number: none below it is free
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    restore = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))  # noqa: E731
    try:
        yield restore
    finally:
        restore()


async def test_emfile_on_connect_waits_for_a_descriptor_and_is_not_unreachable() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b"{}"))
        await reader.read()

    async with RawEngine(serve) as engine:
        with descriptors_exhausted() as restore:
            call = asyncio.create_task(engine.post())
            async with asyncio.timeout(60):  # a guard
                while engine.client.local_exhaustion_waits == 0:  # it hit EMFILE and is waiting, not failing
                    await asyncio.sleep(0.01)
            assert not call.done()
            restore()  # a descriptor frees up
            response = await call
        assert response.status == 200 and await response.read(100) == b"{}"
        fresh = EngineClient(timeout_s=None)  # no pooled connection to reuse: it must connect
        with descriptors_exhausted(), pytest.raises(LocalResourcesExhausted, match="file descriptors"):
            await fresh.post(engine.url, "/v1/chat/completions", b"{}", JSON, local_wait_s=0.2)
        await fresh.close()
