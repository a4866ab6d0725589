"""The sidecar's connection to its engines: one POST, its answer read whole or as it arrives.

An http:// engine is reached by a lean HTTP/1.1 client: httptools (llhttp, the parser uvicorn uses)
parses the answer, keep-alive connections are pooled per host, and the request goes out in one
vectored write. aiohttp's ClientSession did the same with ~90 us of Python a call (measured: a floor
proxy using it spends 0.22 ms of CPU a call, with this client 0.14 ms), which on a 2-core engine host
was most of what the sidecar cost over a bare pass-through. https:// engines (TLS, certificates)
keep aiohttp's session, behind the same interface and the same exceptions.

The client never compresses, follows redirects or retries: the proxy decides (a stale pooled
connection is resent once, an unreachable replica is taken out). An answer's body is buffered
until read, reading paused past HIGH_WATER unread bytes, so a slow harness slows the engine's
stream instead of filling memory.
"""

from __future__ import annotations

import asyncio
import errno
import ssl
from collections.abc import Mapping
from typing import Protocol
from urllib.parse import quote, urlsplit

import aiohttp
import httptools

HIGH_WATER = 1 << 20  # unread answer bytes past which reading the connection pauses
MAX_HEAD_BYTES = 64 * 1024  # an answer's status line and headers together
# Bytes of an answer that are not its body (status lines, headers, interim answers, chunk sizes and
# extensions, trailers), counted as they arrive: at most MAX_HEAD_BYTES plus FRAMING_PER_BODY_BYTE
# times the body so far. A chunk of one byte costs 5 bytes of framing; vLLM's chunks are hundreds.
FRAMING_PER_BODY_BYTE = 8
CONNECT_TIMEOUT_S = 10.0
# A connect that fails for want of a local resource waits for one to free up (calls end, descriptors
# close), this long at most, then the call gets LocalResourcesExhausted.
LOCAL_WAIT_S = 2.0
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})


class EngineUnreachable(Exception):
    """No connection could be made (refused, no such host, connect timeout): try another replica."""


class EngineDisconnected(Exception):
    """The connection closed before the answer's status line: most often a pooled keep-alive
    connection the engine closed as the request went out, so resending once is safe."""


class EngineBrokeOff(Exception):
    """The answer began and then broke: the connection closed or reset mid-body, or it was not HTTP."""


class LocalResourcesExhausted(Exception):
    """This host could not open a connection (no file descriptor, buffer or local port left): the
    sidecar's own limit, not the engine's fault, so the engine is not taken out of service."""


class ResponseTooLarge(Exception):
    """An answer read whole was over the limit given."""


class EngineResponse(Protocol):
    """What the proxy reads of an engine's answer."""

    status: int
    headers: Mapping[str, str]  # get() by lower-case name
    content_length: int | None

    async def readany(self) -> bytes:
        """The bytes that arrived since the last read (waiting for some); b"" at the end."""
        ...

    async def read(self, limit: int) -> bytes:
        """The whole body; ResponseTooLarge past `limit` bytes."""
        ...

    def close(self) -> None:
        """Done with it: an answer not read to its end closes its connection (the engine stops)."""
        ...


def declared_over(answer: EngineResponse, limit: int) -> bool:
    """The answer's Content-Length is past `limit`, so it is refused before a byte is read. A
    compressed answer is left to the bound on the bytes as they are read, as it always was."""
    return answer.content_length is not None and answer.content_length > limit and "content-encoding" not in answer.headers


class _Answer:
    """An answer on a lean connection: headers, then body bytes buffered until read."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_high_water",
        "_loop",
        "_paused",
        "_size",
        "_started",
        "_timer",
        "_waiter",
        "content_length",
        "headers",
        "status",
    )  # fmt: skip

    def __init__(self, conn: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.content_length: int | None = None
        self._conn: _Connection | None = conn  # None once the answer is complete or failed
        self._loop = loop
        self._chunks: list[bytes] = []
        self._size = 0
        self._started: asyncio.Future[None] = loop.create_future()  # the status line and headers are in
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._error: BaseException | None = None
        self._paused = False
        self._high_water = HIGH_WATER
        self._timer: asyncio.TimerHandle | None = None

    # --- fed by the connection ---------------------------------------------------------------
    def _start(self, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers
        length = headers.get("content-length")
        if length is not None and length.isdigit():  # llhttp has refused a malformed one already
            self.content_length = int(length)
        if not self._started.done():
            self._started.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > self._high_water and not self._paused and self._conn is not None:
            self._conn.transport.pause_reading()
            self._paused = True
        self._wake()

    def _finish(self) -> None:
        self._detach()
        self._done = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if self._done or self._error is not None:
            return
        self._detach()
        self._error = error
        if not self._started.done():
            self._started.set_exception(error)
            self._started.exception()  # retrieved: post() may be gone (cancelled) and never await it
        self._wake()

    def _time_out(self) -> None:
        conn = self._conn
        self._fail(TimeoutError("the engine did not finish answering within the sidecar's upstream_timeout_s"))
        if conn is not None:
            conn.transport.abort()

    def _detach(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conn, self._conn = self._conn, None
        if conn is not None and self._paused:
            conn.transport.resume_reading()
            self._paused = False

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # --- read by the proxy ---------------------------------------------------------------------
    async def readany(self) -> bytes:
        while True:
            if self._chunks:
                chunks = self._chunks
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                self._chunks = []
                self._size = 0
                if self._paused and self._conn is not None:
                    self._conn.transport.resume_reading()
                    self._paused = False
                return data
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            await self._wait()

    async def read(self, limit: int) -> bytes:
        if declared_over(self, limit):
            raise ResponseTooLarge
        self._high_water = limit  # past the limit reading pauses, and the answer is refused below
        while not self._done:
            if self._size > limit:
                raise ResponseTooLarge
            if self._error is not None:
                raise self._error
            await self._wait()
        if self._size > limit:
            raise ResponseTooLarge
        data = b"".join(self._chunks)
        self._chunks = []
        self._size = 0
        return data

    def close(self) -> None:
        if self._done or self._error is not None:
            return
        conn = self._conn
        self._fail(EngineBrokeOff("the answer was closed before its end"))
        if conn is not None:
            conn.transport.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine, carrying one request at a time."""

    def __init__(self, client: EngineClient, key: tuple[str, int]) -> None:
        self.client = client
        self.key = key
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
        self.parser = httptools.HttpResponseParser(self)
        self.answer: _Answer | None = None
        self.closed = False
        self.idle_since = 0.0
        self._headers: dict[str, str] = {}
        self._head_bytes = 0
        self._informational = False
        self._refusal: str | None = None  # why a callback stopped the parser
        self._received = 0  # bytes of the current answer received, and of them its body's
        self._body = 0

    # --- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.answer is None:  # bytes nobody asked for: this connection can no longer be trusted
            self.closed = True
            self.transport.close()
            return
        self._received += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._refuse(self._refusal or f"it is not valid HTTP/1.1 ({exc})")
            return
        # Counted as it arrives, not as a header completes: httptools grows a header by concatenation
        # until it ends, so one that never ends would grow the sidecar until it is killed.
        framing = self._received - self._body
        if framing > MAX_HEAD_BYTES + FRAMING_PER_BODY_BYTE * self._body and self.answer is not None:
            self._refuse(f"its headers and framing are over {MAX_HEAD_BYTES} bytes (plus the body's size)")

    def _refuse(self, why: str) -> None:
        answer = self.answer
        self.closed = True
        self.transport.close()
        if answer is not None:
            answer._fail(EngineBrokeOff(f"the engine's answer was refused: {why}"))

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        answer, self.answer = self.answer, None
        if answer is None:
            return
        if not answer._started.done():
            detail = f" ({exc})" if exc else ""
            answer._fail(EngineDisconnected(f"the engine closed the connection before answering{detail}"))
        elif (
            exc is None
            and answer.content_length is None
            and "chunked" not in answer.headers.get("transfer-encoding", "").lower()
        ):
            answer._finish()  # a body delimited by the connection's close (HTTP/1.0 style) is complete
        else:  # a close-delimited body cut by a reset is broken off, not complete
            detail = f" ({exc!r})" if exc else ""
            answer._fail(EngineBrokeOff(f"the engine closed the connection mid-answer{detail}"))

    # --- httptools callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.answer is None:  # a second answer in the same read, to nothing asked: never reuse this
            self.closed = True
            self._refusal = "it sent more than one answer to one request"
            raise ValueError(self._refusal)
        self._headers = {}
        self._head_bytes = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refusal = f"its headers are over {MAX_HEAD_BYTES} bytes"
            raise ValueError(self._refusal)  # stops the parser: feed_data raises HttpParserCallbackError
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        known = self._headers.get(key)
        self._headers[key] = text if known is None else f"{known}, {text}"

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        self._informational = 100 <= status < 200  # 100 Continue and the like: the answer follows
        if not self._informational and self.answer is not None:
            self.answer._start(status, self._headers)

    def on_body(self, body: bytes) -> None:
        self._body += len(body)
        if self.answer is not None:
            self.answer._feed(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        answer, self.answer = self.answer, None
        if answer is None:
            return
        # An answer that came before the whole request went out (an early error) leaves the
        # connection mid-request: never reused.
        keep = self.parser.should_keep_alive() and not self.closed and not self.transport.get_write_buffer_size()
        answer._finish()
        if keep:
            self.client._release(self)
        else:
            self.closed = True
            self.transport.close()


class _Target:
    """An engine URL, split once: where to connect and what to send as Host and path prefix."""

    __slots__ = ("host_header", "key", "prefix", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.tls = parts.scheme == "https"
        host = parts.hostname or ""
        self.key = (host, parts.port or (443 if self.tls else 80))
        netloc = parts.netloc.rpartition("@")[2]
        if not netloc.isascii():  # an internationalized name goes out as its IDNA (xn--) form
            netloc = host.encode("idna").decode("ascii") + (f":{parts.port}" if parts.port else "")
        self.host_header = netloc.encode("ascii")
        self.prefix = quote(parts.path.rstrip("/"), safe="/%:@!$&'()*+,;=").encode("ascii")


class _AiohttpAnswer:
    """aiohttp's answer (an https:// engine) behind the same interface and exceptions."""

    __slots__ = ("_response", "content_length", "headers", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers = response.headers
        self.content_length = response.content_length

    async def readany(self) -> bytes:
        try:
            return await self._response.content.readany()
        except aiohttp.ClientError as exc:
            raise EngineBrokeOff(f"the engine's answer broke off ({exc!r})") from exc

    async def read(self, limit: int) -> bytes:
        if declared_over(self, limit):
            raise ResponseTooLarge
        parts: list[bytes] = []
        size = 0
        while True:
            part = await self.readany()
            if not part:
                return b"".join(parts)
            size += len(part)
            if size > limit:
                raise ResponseTooLarge
            parts.append(part)

    def close(self) -> None:
        self._response.close()


class EngineClient:
    """POSTs to engines: http:// on pooled lean connections, https:// through aiohttp."""

    def __init__(
        self, timeout_s: float | None, keepalive_s: float = 60.0, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.timeout_s = timeout_s  # a whole call, connect to last byte; None: no limit
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._targets: dict[str, _Target] = {}
        self._session: aiohttp.ClientSession | None = None
        self._ssl = ssl_context  # None: the system's trust store, as aiohttp's default
        self.connections_made = 0  # to http:// engines; /metrics shows it beside the calls made
        self.local_exhaustion_waits = 0  # connects that found no local resource (EMFILE...) and waited

    async def post(
        self, url: str, path: str, body: bytes, headers: Mapping[str, str], *, local_wait_s: float | None = None
    ) -> EngineResponse:
        """POST `body` to `url` + `path` with `headers` (Host, Content-Length and Accept-Encoding:
        identity are added); returns once the answer's status line and headers are in. A connect that
        finds no local resource (EMFILE...) waits up to `local_wait_s` for one, then raises
        LocalResourcesExhausted."""
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = _Target(url)
        if target.tls:
            return await self._post_tls(url + path, body, headers)
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} holds a line break: it cannot be sent")
        loop = asyncio.get_running_loop()
        started = loop.time()
        conn = self._take_idle(target.key, loop.time())
        if conn is None:
            conn = await self._connect(target.key, loop, LOCAL_WAIT_S if local_wait_s is None else local_wait_s)
        answer = _Answer(conn, loop)
        conn.answer = answer
        conn._received = conn._body = 0
        if self.timeout_s is not None:
            answer._timer = loop.call_at(started + self.timeout_s, answer._time_out)
        head = b"POST %s%s HTTP/1.1\r\nHost: %s\r\nAccept-Encoding: identity\r\nContent-Length: %d\r\n" % (
            target.prefix, path.encode("ascii"), target.host_header, len(body)
        )
        # surrogateescape: a header aiohttp's server decoded from bytes that were not UTF-8 goes on as it came
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items()).encode("utf-8", "surrogateescape")
        conn.transport.writelines((head, extra, b"\r\n", body))
        try:
            await answer._started
        except BaseException:
            answer.close()  # cancelled (the harness left) or failed: the connection is not reused
            raise
        return answer

    def _take_idle(self, key: tuple[str, int], now: float) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed and not conn.transport.is_closing() and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.closed = True
            conn.transport.close()
        return None

    async def _connect(self, key: tuple[str, int], loop: asyncio.AbstractEventLoop, local_wait_s: float) -> _Connection:
        host, port = key
        give_up = loop.time() + local_wait_s
        pause = 0.01
        while True:
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    _, conn = await loop.create_connection(lambda: _Connection(self, key), host, port)
            except TimeoutError as exc:
                raise EngineUnreachable(
                    f"Cannot connect to host {host}:{port}: no answer within {CONNECT_TIMEOUT_S:g} s"
                ) from exc
            except OSError as exc:
                if exc.errno not in LOCAL_ERRNOS:
                    raise EngineUnreachable(f"Cannot connect to host {host}:{port} ({exc})") from exc
                # This host's limit (descriptors, buffers, ports): calls ending free them, so wait a little.
                self.local_exhaustion_waits += 1
                if loop.time() + pause > give_up:
                    raise LocalResourcesExhausted(_local_reason(exc, host, port)) from exc
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.2)
                continue
            self.connections_made += 1
            return conn

    @property
    def idle_connections(self) -> int:
        """Pooled connections waiting for a call (some may have been closed by their engine since)."""
        return sum(len(idle) for idle in self._idle.values())

    def _release(self, conn: _Connection) -> None:
        conn.idle_since = asyncio.get_running_loop().time()
        self._idle.setdefault(conn.key, []).append(conn)

    async def _post_tls(self, url: str, body: bytes, headers: Mapping[str, str]) -> EngineResponse:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=CONNECT_TIMEOUT_S),
                connector=aiohttp.TCPConnector(
                    limit=0, ttl_dns_cache=300, keepalive_timeout=self.keepalive_s, ssl=self._ssl or True
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
                headers={"Accept-Encoding": "identity"},  # the answers are read and passed on as they came
            )
        try:
            response = await self._session.post(url, data=body, headers=dict(headers))
        except aiohttp.ClientConnectorError as exc:
            if exc.os_error.errno in LOCAL_ERRNOS:
                raise LocalResourcesExhausted(_local_reason(exc.os_error, exc.host, exc.port)) from exc
            raise EngineUnreachable(str(exc)) from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise EngineDisconnected(repr(exc)) from exc
        except aiohttp.ClientError as exc:
            raise EngineBrokeOff(repr(exc)) from exc
        return _AiohttpAnswer(response)

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.transport.close()
        self._idle.clear()
        if self._session is not None:
            await self._session.close()


def _local_reason(exc: OSError, host: str, port: int | None) -> str:
    what = {errno.EMFILE: "this process's open file descriptors (ulimit -n)",
            errno.ENFILE: "the system's open files", errno.EADDRNOTAVAIL: "local ports"}.get(exc.errno or 0,
                                                                                           "memory or buffers")  # fmt: skip
    return f"no connection to {host}:{port} could be opened: the sidecar's host ran out of {what} ({exc.strerror})"
