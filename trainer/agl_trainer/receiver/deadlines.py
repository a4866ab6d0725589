"""Half-sent requests are not held forever: a connection whose request headers have not all arrived
`header_timeout_s` after it opened (or after the first bytes of its next request, on a kept-alive
connection) is closed, and a body still arriving `body_timeout_s` after its headers is answered 408 (server.py).
Before, 240 connections that sent half a request exhausted a 256-descriptor limit and every sender's
export failed.

`HeaderDeadline.wrap` wraps aiohttp's protocol factory: each connection gets a timer when it opens,
and again when bytes arrive while no request of it is being handled; the app's middleware
(`started`) cancels it once a request's head is parsed. An idle kept-alive connection is aiohttp's
(its keepalive_timeout), not counted here. `ByteBudget` bounds the request bodies held at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web


class HeaderDeadline:
    def __init__(self, timeout_s: float, on_expire: Callable[[], None]) -> None:
        self._timeout_s = timeout_s
        self._on_expire = on_expire
        self._timers: dict[Any, asyncio.TimerHandle] = {}  # transport -> its timer
        self._busy: set[Any] = set()  # transports whose request is being handled (its body has its own deadline)

    def wrap(self, factory: Callable[[], Any]) -> Callable[[], Any]:
        """aiohttp's protocol factory, each connection it makes under the deadline."""
        return lambda: self._watch(factory())

    def _watch(self, protocol: Any) -> asyncio.Protocol:
        return _Watched(protocol, self)

    def heard(self, transport: Any) -> None:
        """Bytes arrived: the start of a request's head unless one is being handled."""
        if transport not in self._busy and transport not in self._timers:
            self.arm(transport)

    def arm(self, transport: Any) -> None:
        self.disarm(transport)
        if transport.is_closing():
            return
        loop = asyncio.get_running_loop()
        self._timers[transport] = loop.call_later(self._timeout_s, self._expire, transport)

    def disarm(self, transport: Any) -> None:
        timer = self._timers.pop(transport, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, transport: Any) -> None:
        self._timers.pop(transport, None)
        if not transport.is_closing():
            self._on_expire()
            transport.close()

    @property
    def open(self) -> int:
        """Connections waiting for a request's headers (the tests look here)."""
        return len(self._timers)

    def middleware(self) -> Callable:
        @web.middleware
        async def started(request: web.Request, handler: Callable) -> web.StreamResponse:
            transport = request.transport
            if transport is None:
                return await handler(request)
            self.disarm(transport)  # the head is here: the body has its own deadline
            self._busy.add(transport)
            try:
                return await handler(request)
            finally:
                self._busy.discard(transport)

        return started


class _Watched(asyncio.Protocol):
    """aiohttp's protocol for one connection (its slots take no new methods), with the timer."""

    def __init__(self, inner: Any, deadline: HeaderDeadline) -> None:
        self._inner = inner
        self._deadline = deadline
        self._transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        self._inner.connection_made(transport)
        self._deadline.arm(transport)

    def connection_lost(self, error: Exception | None) -> None:
        if self._transport is not None:
            self._deadline.disarm(self._transport)
        self._inner.connection_lost(error)

    def data_received(self, data: bytes) -> None:
        if self._transport is not None:
            self._deadline.heard(self._transport)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class DeadlineSite(web.TCPSite):
    """aiohttp's TCPSite, its connections under a HeaderDeadline."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, deadline: HeaderDeadline) -> None:
        super().__init__(runner, host, port)
        self._deadline = deadline

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._deadline.wrap(server), self._host, self._port, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port,
        )  # fmt: skip


class ByteBudget:
    """Request bodies held at once, in bytes: a request reserves its size (Content-Length, else the
    largest allowed) before reading and gives it back once answered; past the budget it waits. The
    body bytes in memory are bounded whatever the number of senders."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._waiting: asyncio.Condition | None = None
        self._wakes: set[asyncio.Task] = set()  # kept until done (the loop holds tasks weakly)

    async def take(self, size: int) -> None:
        if self._waiting is None:
            self._waiting = asyncio.Condition()
        async with self._waiting:
            await self._waiting.wait_for(lambda: self.free >= size)
            self.free -= size

    def give(self, size: int) -> None:
        self.free += size
        if self._waiting is not None:
            waiting = self._waiting

            async def wake() -> None:
                async with waiting:
                    waiting.notify_all()

            task = asyncio.get_running_loop().create_task(wake())
            self._wakes.add(task)
            task.add_done_callback(self._wakes.discard)
