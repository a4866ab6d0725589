"""A stand-in engine that answers each request with exactly the bytes a test scripts, over a real
loopback socket: real vLLM captures replayed byte for byte, the same responses spelled as another
server would spell them, or a stream cut off mid-way as when the engine process dies.

    with ScriptedEngine(lambda request: Reply(body=b"...")) as engine:
        engine.base_url, engine.requests   # each request as (method, path, headers, body)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.support.captures import VLLM_CAPTURES


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Reply:
    """`body` as one response (Content-Length), or `chunks` as a chunked stream; `cut` closes the
    connection after the chunks without the terminating chunk (the engine died)."""

    status: int = 200
    content_type: str = "application/json"
    body: bytes = b""
    chunks: list[bytes] = field(default_factory=list)
    cut: bool = False


def capture(name: str) -> bytes:
    return (VLLM_CAPTURES / name).read_bytes()


def sse_events(name: str) -> list[bytes]:
    """The events of a captured vLLM stream, each with its `\\n\\n` separator."""
    return [event + b"\n\n" for event in capture(name).split(b"\n\n") if event.strip()]


class ScriptedEngine:
    def __init__(self, answer: Callable[[Request], Reply]) -> None:
        self.answer = answer
        self.requests: list[Request] = []
        self.base_url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ScriptedEngine:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            self._server = loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
            self.base_url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
            ready.set()
            loop.run_forever()
            self._server.close()
            # Finish the connections' tasks here: left to the garbage collector, they would run
            # their cleanup on whichever thread collects them, at any moment.
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(self._server.wait_closed())
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True, name="scripted-engine")
        self._thread.start()
        ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        key, value = line.split(":", 1)
                        headers[key.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                request = Request(method, path, headers, body)
                if path == "/health":
                    reply = Reply(body=b"")
                else:
                    self.requests.append(request)
                    reply = self.answer(request)
                if not await self._send(writer, reply):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, reply: Reply) -> bool:
        """Send `reply`; False when the connection was closed on purpose."""
        head = f"HTTP/1.1 {reply.status} OK\r\ncontent-type: {reply.content_type}\r\n"
        if reply.chunks:
            writer.write((head + "transfer-encoding: chunked\r\n\r\n").encode())
            for chunk in reply.chunks:
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
                await asyncio.sleep(0.01)
            if reply.cut:
                writer.transport.abort()  # the engine process died: no terminating chunk
                return False
            writer.write(b"0\r\n\r\n")
        else:
            writer.write((head + f"content-length: {len(reply.body)}\r\n\r\n").encode() + reply.body)
        await writer.drain()
        return True
