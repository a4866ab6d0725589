"""Durable mode (`--durable-spans`): a call's span is on disk before the harness gets its last byte.

Without it, a span lives in memory from the moment its call is answered until the endpoint
acknowledges it (or it is spooled): a SIGKILL in that window loses it. In durable mode the recorder
builds the span on the call's path, `SpanLog` appends it to a write-ahead log in the spool slot and
fsyncs it (one fsync for every call that reached that point meanwhile: group commit), and only then
does the response send its final bytes. The exporter sends from memory as usual; a log segment is
deleted once every span in it is acknowledged, spooled (fsync-ed) or counted as failed. At start,
segments left by a killed sidecar become spool files and are replayed; spans the endpoint had
already acknowledged before the kill may then arrive twice (the agl receiver ignores duplicates).

A call's span is on disk before its last bytes go, so a kill between the two leaves the span of a
call whose harness saw an error. Once the last bytes are handed to the connection, a delivery
marker (the span's trace and span id) follows the span in the log, written without an fsync of
its own (a SIGKILL does not lose what was written; a power loss may). A call span recovered
without its marker gets `agl.call.delivery = unknown`: the receiver stores its end as
`delivery_unknown`, and assembly trains it only when a later call of its rollout builds on its
answer (the harness evidently got it).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from agl import semconv
from agl_sidecar.spans import otlp
from agl_sidecar.spans.spool import WAL_SUFFIX, Spool, fsync_dir

log = logging.getLogger("agl_sidecar.durable")

_SPAN_TAG = b"\x12"  # ScopeSpans.spans: a segment's bytes are a run of framed spans
_DELIVERED_TAG = b"\x1a"  # a delivery marker: a span's identity (its first 28 bytes)
IDENTITY_BYTES = 28  # an encoded span opens with its trace id (field 1) and span id (field 2): otlp.span
# The identity of the span the current task appended last (a call's, in its handler's task: the
# response reads it after persisting, to mark the call delivered once its last bytes are out).
_appended: contextvars.ContextVar[bytes | None] = contextvars.ContextVar("agl_durable_appended", default=None)


class SpanLog:
    """Append-only, group-fsynced log of spans not yet settled by the exporter."""

    def __init__(self, spool: Spool) -> None:
        self._spool = spool
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="agl-span-log")
        self._buffer: list[bytes] = []
        self._appended = 0  # spans appended (event loop)
        self._synced = 0  # spans on disk, or given up on (event loop)
        self._written = 0  # spans written to a segment (log thread)
        self._syncing: asyncio.Task[None] | None = None
        self._fd: int | None = None
        self._path: Path | None = None
        self._closed: deque[tuple[Path, int]] = deque()  # (segment, spans written up to its end)
        self._settled = 0
        self.write_failures = 0  # spans that could not be made durable (disk full...): still exported
        self._markers: list[bytes] = []  # delivery markers not yet written (mark_delivered)
        self._marking: asyncio.Task[None] | None = None

    # --- event loop side -----------------------------------------------------------------------
    def append(self, span: bytes) -> None:
        """Queue a span for the log; it is written by the next group commit, which starts now if
        none is running (a span nobody awaits, such as a failed call's, reaches the disk too)."""
        self._buffer.append(_SPAN_TAG + otlp.varint(len(span)) + span)
        self._appended += 1
        _appended.set(bytes(span[:IDENTITY_BYTES]))
        if self._syncing is None:
            try:
                self._syncing = asyncio.get_running_loop().create_task(self._sync_once())
            except RuntimeError:  # no loop running (a synchronous caller): the next sync() writes it
                pass

    def mark_delivered(self, identity: bytes) -> None:
        """The last bytes of the call whose span is `identity` went to its connection: a marker
        follows the span in the log, written now without an fsync of its own."""
        self._markers.append(_DELIVERED_TAG + otlp.varint(len(identity)) + identity)
        if self._marking is None:
            self._marking = asyncio.get_running_loop().create_task(self._write_markers())

    async def _write_markers(self) -> None:
        try:
            while self._markers:
                markers, self._markers = self._markers, []
                await asyncio.get_running_loop().run_in_executor(self._pool, self._write_unsynced, markers)
        except OSError as exc:  # only the markers are lost: those calls count as delivery unknown
            log.warning("agl-sidecar: durable span log: cannot write delivery markers: %s", exc)
        finally:
            self._marking = None

    async def sync(self) -> None:
        """Return once every span appended so far is on disk (or could not be written: counted)."""
        target = self._appended
        while self._synced < target:
            if self._syncing is None:
                self._syncing = asyncio.get_running_loop().create_task(self._sync_once())
            await asyncio.shield(self._syncing)

    async def _sync_once(self) -> None:
        chunks, upto = self._buffer, self._appended
        self._buffer = []
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._write, chunks, upto)
        except OSError as exc:
            self.write_failures += upto - self._synced
            log.error("agl-sidecar: durable span log: cannot write %s: %s; those spans are only in memory", self._path, exc)
        finally:
            self._synced = upto
            self._syncing = None

    async def rotate(self) -> None:
        """Close the current segment (the exporter calls this before it takes spans to send)."""
        if self._fd is not None:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._close_segment)

    def settle(self, spans: int) -> None:
        """`spans` more spans (in submission order) are acknowledged, spooled or counted as failed."""
        self._settled += spans
        while self._closed and self._closed[0][1] <= self._settled:
            path, _ = self._closed.popleft()
            path.unlink(missing_ok=True)

    async def close(self) -> None:
        if self._marking is not None:
            await self._marking
        await self.sync()
        await self.rotate()
        self.settle(0)
        self._pool.shutdown(wait=True)

    # --- log thread ----------------------------------------------------------------------------
    def _write(self, chunks: list[bytes], upto: int) -> None:
        if self._fd is None:
            self._path = self._spool.new_name(WAL_SUFFIX)
            self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            fsync_dir(self._path.parent)
        data = b"".join(chunks)
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
            os.fdatasync(self._fd)
        except OSError:
            # The segment may now end in a partial span, which ends its recovery: later spans go to
            # a new segment. This one is deleted once the spans written before it are settled.
            self._close_segment()
            raise
        self._written = upto

    def _write_unsynced(self, chunks: list[bytes]) -> None:
        """Delivery markers: written to the current segment (or a new one), no fsync."""
        if self._fd is None:
            self._path = self._spool.new_name(WAL_SUFFIX)
            self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        view = memoryview(b"".join(chunks))
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError:
            self._close_segment()  # a torn marker ends this segment's recovery: later spans go to a new one
            raise

    def _close_segment(self) -> None:
        if self._fd is None or self._path is None:
            return
        os.close(self._fd)
        self._closed.append((self._path, self._written))
        self._fd, self._path = None, None


def read_segment(path: Path, delivered: set[bytes] | None = None) -> Iterator[bytes]:
    """The spans of a log segment (its delivery markers go to `delivered`); a record cut short by
    a crash (its call was never answered) ends it."""
    data = path.read_bytes()
    at = 0
    while at < len(data):
        if data[at] not in (_SPAN_TAG[0], _DELIVERED_TAG[0]):
            break
        try:
            size, start = otlp._read_varint(data, at + 1)
        except ValueError:
            break
        if start + size > len(data):
            break
        if data[at] == _SPAN_TAG[0]:
            yield data[start : start + size]
        elif delivered is not None:
            delivered.add(data[start : start + size])
        at = start + size


SPAN_KIND_CLIENT = 3  # a model call's span; rewards and rollout ends are INTERNAL


def unknown_delivery(span: bytes, delivered: set[bytes]) -> bytes:
    """A recovered span as it is sent: a call span (kind CLIENT) without a delivery marker gets
    `agl.call.delivery = unknown` (an attribute appended: protobuf concatenates repeated fields)."""
    if bytes(span[:IDENTITY_BYTES]) in delivered:
        return span
    try:
        kind = next((value for number, wire, value in otlp._fields(span) if number == 6 and wire == 0), None)
    except ValueError:
        return span  # not a span this sidecar wrote whole: sent as it is (the receiver judges it)
    if kind != SPAN_KIND_CLIENT:
        return span
    return span + otlp.attributes(9, [(semconv.CALL_DELIVERY, semconv.DELIVERY_UNKNOWN)])


# --- responses whose final bytes wait for the span -------------------------------------------------
Persist = Callable[[], Awaitable[None]]


class _DurableResponse(web.Response):
    def __init__(self, persist: Persist, log: SpanLog | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._persist = persist
        self._log = log

    async def write_eof(self, data: bytes = b"") -> None:
        if self._eof_sent:
            return await super().write_eof(data)
        await self._persist()
        identity = _appended.get()  # the call's span, appended by persist in this task
        await super().write_eof(data)
        _delivered(self._log, identity)


class _DurableStreamResponse(web.StreamResponse):
    """Holds back the latest chunk (the stream's end, `[DONE]` or its protocol's last event, is in
    the last one) until the span is on disk."""

    def __init__(self, persist: Persist, log: SpanLog | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._persist = persist
        self._log = log
        self._held = b""

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        held, self._held = self._held, bytes(data)
        if held:
            await super().write(held)

    async def write_eof(self, data: bytes = b"") -> None:
        if self._eof_sent:
            return await super().write_eof(data)
        await self._persist()
        identity = _appended.get()
        held, self._held = self._held, b""
        await super().write_eof(held + bytes(data))
        _delivered(self._log, identity)


def _delivered(log: SpanLog | None, identity: bytes | None) -> None:
    """The response's last bytes went to its connection: mark its call's span delivered."""
    if log is not None and identity is not None:
        log.mark_delivered(identity)


def delivered_now(log: SpanLog | None) -> None:
    """A response's last bytes went out in this task (a sink of its own, e.g. a WebSocket's
    messages): mark the span its persist appended delivered."""
    _delivered(log, _appended.get())


def unary_response(persist: Persist | None, log: SpanLog | None = None, **kwargs: Any) -> web.Response:
    return web.Response(**kwargs) if persist is None else _DurableResponse(persist, log, **kwargs)


def stream_response(persist: Persist | None, log: SpanLog | None = None, **kwargs: Any) -> web.StreamResponse:
    return web.StreamResponse(**kwargs) if persist is None else _DurableStreamResponse(persist, log, **kwargs)
