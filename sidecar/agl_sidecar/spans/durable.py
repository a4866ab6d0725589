"""Durable mode (`--durable-spans`): a call's span is on disk before the harness gets its last byte.

Without it, a span lives in memory from the moment its call is answered until the endpoint
acknowledges it (or it is spooled): a SIGKILL in that window loses it. In durable mode the recorder
builds the span on the call's path, `SpanLog` appends it to a write-ahead log in the spool slot and
fsyncs it (one fsync for every call that reached that point meanwhile: group commit), and only then
does the response send its final bytes. The exporter sends from memory as usual; a log segment is
deleted once every span in it is acknowledged, spooled (fsync-ed) or counted as failed. At start,
segments left by a killed sidecar become spool files and are replayed; spans the endpoint had
already acknowledged before the kill may then arrive twice (the agl receiver ignores duplicates).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from agl_sidecar.spans import otlp
from agl_sidecar.spans.spool import WAL_SUFFIX, Spool, fsync_dir

log = logging.getLogger("agl_sidecar.durable")

_SPAN_TAG = b"\x12"  # ScopeSpans.spans: a segment's bytes are a run of framed spans


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

    # --- event loop side -----------------------------------------------------------------------
    def append(self, span: bytes) -> None:
        """Queue a span for the log; it is written by the next group commit, which starts now if
        none is running (a span nobody awaits, such as a failed call's, reaches the disk too)."""
        self._buffer.append(_SPAN_TAG + otlp.varint(len(span)) + span)
        self._appended += 1
        if self._syncing is None:
            try:
                self._syncing = asyncio.get_running_loop().create_task(self._sync_once())
            except RuntimeError:  # no loop running (a synchronous caller): the next sync() writes it
                pass

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

    def _close_segment(self) -> None:
        if self._fd is None or self._path is None:
            return
        os.close(self._fd)
        self._closed.append((self._path, self._written))
        self._fd, self._path = None, None


def read_segment(path: Path) -> Iterator[bytes]:
    """The spans of a log segment; a span cut short by a crash (its call was never answered) ends it."""
    data = path.read_bytes()
    at = 0
    while at < len(data):
        if data[at] != 0x12:
            break
        try:
            size, start = otlp._read_varint(data, at + 1)
        except ValueError:
            break
        if start + size > len(data):
            break
        yield data[start : start + size]
        at = start + size


# --- responses whose final bytes wait for the span -------------------------------------------------
Persist = Callable[[], Awaitable[None]]


class _DurableResponse(web.Response):
    def __init__(self, persist: Persist, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._persist = persist

    async def write_eof(self, data: bytes = b"") -> None:
        if not self._eof_sent:
            await self._persist()
        await super().write_eof(data)


class _DurableStreamResponse(web.StreamResponse):
    """Holds back the latest chunk (the stream's end, `[DONE]` or its protocol's last event, is in
    the last one) until the span is on disk."""

    def __init__(self, persist: Persist, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._persist = persist
        self._held = b""

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        held, self._held = self._held, bytes(data)
        if held:
            await super().write(held)

    async def write_eof(self, data: bytes = b"") -> None:
        if not self._eof_sent:
            await self._persist()
        held, self._held = self._held, b""
        await super().write_eof(held + bytes(data))


def unary_response(persist: Persist | None, **kwargs: Any) -> web.Response:
    return web.Response(**kwargs) if persist is None else _DurableResponse(persist, **kwargs)


def stream_response(persist: Persist | None, **kwargs: Any) -> web.StreamResponse:
    return web.StreamResponse(**kwargs) if persist is None else _DurableStreamResponse(persist, **kwargs)
