"""Span export: OTLP/HTTP protobuf (or gRPC), batched by bytes, gzip, retried, spooled to disk.

The hot path only appends encoded span bytes to a queue. A background task frames batches below
`max_batch_bytes` (collectors reject gRPC messages over 4 MiB), compresses them in a worker thread
(zlib releases the GIL) and sends them. While the endpoint is down, batches go to the spool directory
as ready-to-send files and are replayed oldest first once a probe succeeds, with exponential backoff
between probes. Memory is bounded: past `max_memory_bytes` pending spans go to the spool at once.
A span that cannot be kept (spool full or unwritable, or rejected by the endpoint as malformed) is
counted as failed and logged: never dropped silently.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from agl_sidecar.otlp import RequestFramer

log = logging.getLogger("agl_sidecar.exporter")

SPOOL_SUFFIX = ".otlp.gz"
RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
GRPC_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


@dataclass
class ExportCounters:
    spans_submitted: int = 0
    spans_exported: int = 0
    spans_spooled: int = 0
    spans_replayed: int = 0
    spans_failed: int = 0
    spans_pending: int = 0
    bytes_exported: int = 0
    bytes_spooled: int = 0
    export_requests: int = 0
    export_errors: int = 0
    spool_files: int = 0
    extra: dict[str, int] = field(default_factory=dict)


def traces_url(endpoint: str) -> str:
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


class SpanExporter:
    def __init__(
        self,
        endpoint: str | None,
        framer: RequestFramer,
        spool_dir: str | os.PathLike[str],
        *,
        protocol: str = "http/protobuf",
        headers: dict[str, str] | None = None,
        max_batch_bytes: int = 3 * 1024 * 1024,
        max_memory_bytes: int = 64 * 1024 * 1024,
        max_spool_bytes: int = 8 * 1024**3,
        interval_s: float = 0.25,
        timeout_s: float = 10.0,
        max_backoff_s: float = 30.0,
        compression_level: int = 1,
        compress: bool = True,
    ) -> None:
        self.endpoint = endpoint
        self.protocol = protocol
        self.framer = framer
        self.spool_dir = Path(spool_dir)
        self.headers = dict(headers or {})
        self.max_batch_bytes = max_batch_bytes
        self.max_memory_bytes = max_memory_bytes
        self.max_spool_bytes = max_spool_bytes
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self.compression_level = compression_level
        self.compress = compress
        self.counters = ExportCounters()
        self.down = False
        self._pending: deque[bytes] = deque()
        self._pending_bytes = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._grpc: object | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="agl-export")
        self._backoff_s = 0.5
        self._next_probe = 0.0
        self._file_seq = 0
        self._warned_no_endpoint = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False
        self._in_flight: list[bytes] | None = None  # the batch being sent: spooled if cut short

    # --- hot path ------------------------------------------------------------------------------
    def submit(self, span: bytes) -> None:
        """Queue one encoded span (cheap: an append)."""
        self.counters.spans_submitted += 1
        if self.endpoint is None:
            self.counters.spans_failed += 1
            if not self._warned_no_endpoint:
                self._warned_no_endpoint = True
                log.error("agl-sidecar: no --otlp-endpoint configured; spans are counted as failed, not exported")
            return
        self._pending.append(span)
        self._pending_bytes += self.framer.overhead(span)
        self.counters.spans_pending = len(self._pending)
        self._idle.clear()
        if self._pending_bytes >= self.max_batch_bytes:
            self._wake.set()

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.counters.spool_files = len(self._spool_files())
        if self.counters.spool_files:
            self._idle.clear()  # spans from an earlier run wait to be replayed
        if self.endpoint is None:
            return
        if self.protocol == "grpc":
            self._grpc = _GrpcSender(self.endpoint, self.headers, self.timeout_s)
        else:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(limit=4),
            )
        self._task = asyncio.create_task(self._run(), name="agl-span-exporter")

    async def flush(self, timeout_s: float = 10.0) -> bool:
        """Send (or spool) everything queued so far; True when nothing is left pending."""
        if self._task is None:
            return not self._pending
        self._wake.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self, timeout_s: float = 5.0) -> None:
        """Send what is pending; whatever cannot be sent in time goes to the spool."""
        if self._task is not None:
            self._stopping = True
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except (TimeoutError, Exception):
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        leftover = ([self._in_flight] if self._in_flight else []) + self._take_batches()
        self._in_flight = None
        if leftover:
            await self._spool_batches(leftover)
        if self._session is not None:
            await self._session.close()
        if self._grpc is not None:
            await self._grpc.close()  # type: ignore[attr-defined]
        self._pool.shutdown(wait=True)

    # --- background loop -----------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            if not self._stopping:
                try:
                    await asyncio.wait_for(self._wake.wait(), self.interval_s)
                except TimeoutError:
                    pass
            self._wake.clear()
            try:
                await self._cycle()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep exporting whatever one cycle hit
                log.exception("agl-sidecar: span export cycle failed")
            if not self._pending and (self.counters.spool_files == 0 or self.down):
                self._idle.set()
                if self._stopping:
                    return

    async def _cycle(self) -> None:
        if self._pending_bytes > self.max_memory_bytes:
            await self._spool_batches(self._take_batches())
        if self.counters.spool_files and (time.monotonic() >= self._next_probe or self._stopping and not self.down):
            await self._replay()
        while self._pending:
            if self.down or self.counters.spool_files:
                await self._spool_batches(self._take_batches())  # keep order: older spans are spooled
                return
            batch = self._in_flight = self._next_batch()
            payload = await self._encode(batch)
            outcome = await self._send(payload, compressed=self.compress)
            if outcome == "ok":
                self.counters.spans_exported += len(batch)
            elif outcome == "rejected":
                self._fail(len(batch), "rejected by the endpoint")
            else:
                self._mark_down()
                if not self.compress:
                    payload = await self._gzip(payload)
                await self._write_spool(payload, len(batch))
            self._in_flight = None

    def _next_batch(self) -> list[bytes]:
        batch: list[bytes] = []
        size = 0
        while self._pending:
            cost = self.framer.overhead(self._pending[0])
            if batch and size + cost > self.max_batch_bytes:
                break
            batch.append(self._pending.popleft())
            self._pending_bytes -= cost
            size += cost
        self.counters.spans_pending = len(self._pending)
        return batch

    def _take_batches(self) -> list[list[bytes]]:
        batches: list[list[bytes]] = []
        batch: list[bytes] = []
        size = 0
        while self._pending:
            span = self._pending.popleft()
            cost = self.framer.overhead(span)
            self._pending_bytes -= cost
            if batch and size + cost > self.max_batch_bytes:
                batches.append(batch)
                batch, size = [], 0
            batch.append(span)
            size += cost
        if batch:
            batches.append(batch)
        self.counters.spans_pending = 0
        self._pending_bytes = 0
        return batches

    async def _encode(self, batch: Sequence[bytes]) -> bytes:
        """The request body for `batch`: gzipped (in the worker thread) unless compression is off."""
        request = self.framer.request(batch)
        if self.protocol == "grpc" or not self.compress:
            return request
        return await self._gzip(request)

    async def _gzip(self, data: bytes) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(self._pool, gzip.compress, data, self.compression_level)

    async def _send(self, payload: bytes, compressed: bool = True) -> str:
        """"ok", "rejected" (not worth retrying) or "retry"."""
        self.counters.export_requests += 1
        if self._grpc is not None:
            outcome = await self._grpc.send(payload)  # type: ignore[attr-defined]
            if outcome != "ok":
                self.counters.export_errors += 1
            else:
                self.counters.bytes_exported += len(payload)
            return outcome
        assert self._session is not None and self.endpoint is not None
        headers = {"content-type": "application/x-protobuf", **self.headers}
        if compressed:
            headers["content-encoding"] = "gzip"
        try:
            async with self._session.post(traces_url(self.endpoint), data=payload, headers=headers) as response:
                await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.counters.export_errors += 1
            log.warning("agl-sidecar: OTLP endpoint %s unreachable: %s", self.endpoint, exc)
            return "retry"
        if 200 <= status < 300:
            self.counters.bytes_exported += len(payload)
            return "ok"
        self.counters.export_errors += 1
        if status in RETRYABLE_STATUS:
            log.warning("agl-sidecar: OTLP endpoint answered %s; spooling and retrying", status)
            return "retry"
        log.error("agl-sidecar: OTLP endpoint rejected a batch with HTTP %s", status)
        return "rejected"

    def _mark_down(self) -> None:
        if not self.down:
            log.warning("agl-sidecar: OTLP endpoint down; spooling spans to %s", self.spool_dir)
        self.down = True
        self._next_probe = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)

    async def _replay(self) -> None:
        for path in self._spool_files():
            try:
                payload = path.read_bytes()
            except OSError as exc:
                log.error("agl-sidecar: cannot read spool file %s: %s", path, exc)
                continue
            spans = _spans_in_name(path)
            if self.protocol == "grpc":
                payload = gzip.decompress(payload)
            outcome = await self._send(payload)
            if outcome == "retry":
                self._mark_down()
                return
            if outcome == "ok":
                self.counters.spans_exported += spans
                self.counters.spans_replayed += spans
            else:
                self._fail(spans, f"spool file {path.name} rejected by the endpoint")
            path.unlink(missing_ok=True)
            self.counters.spool_files = max(0, self.counters.spool_files - 1)
        if self.down:
            log.warning("agl-sidecar: OTLP endpoint is back; spool replayed")
        self.down = False
        self._backoff_s = 0.5
        self.counters.spool_files = len(self._spool_files())

    async def _spool_batches(self, batches: list[list[bytes]]) -> None:
        for batch in batches:
            await self._write_spool(await self._gzip(self.framer.request(batch)), len(batch))

    async def _write_spool(self, payload: bytes, spans: int) -> None:
        if self._spool_bytes() + len(payload) > self.max_spool_bytes:
            self._fail(spans, f"spool {self.spool_dir} is full ({self.max_spool_bytes} bytes)")
            return
        self._file_seq += 1
        name = f"{time.time_ns():020d}-{os.getpid()}-{self._file_seq:08d}-{spans}{SPOOL_SUFFIX}"
        path = self.spool_dir / name
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, _write_atomic, path, payload)
        except OSError as exc:
            self._fail(spans, f"cannot write spool file {path}: {exc}")
            return
        self.counters.spans_spooled += spans
        self.counters.bytes_spooled += len(payload)
        self.counters.spool_files += 1

    def _spool_files(self) -> list[Path]:
        try:
            return sorted(self.spool_dir.glob("*" + SPOOL_SUFFIX))
        except OSError:
            return []

    def _spool_bytes(self) -> int:
        total = 0
        for path in self._spool_files():
            try:
                total += path.stat().st_size
            except OSError:
                pass
        return total

    def _fail(self, spans: int, why: str) -> None:
        self.counters.spans_failed += spans
        log.error("agl-sidecar: %d span(s) lost: %s (%d lost so far)", spans, why, self.counters.spans_failed)


def _write_atomic(path: Path, payload: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _spans_in_name(path: Path) -> int:
    try:
        return int(path.name[: -len(SPOOL_SUFFIX)].rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 0


class _GrpcSender:
    """OTLP/gRPC with pre-encoded request bytes (identity serializers), loaded only when chosen."""

    def __init__(self, endpoint: str, headers: dict[str, str], timeout_s: float) -> None:
        import grpc

        target = endpoint.split("://", 1)[-1].rstrip("/")
        secure = endpoint.startswith("https://")
        self._grpc = grpc
        self._channel = (
            grpc.aio.secure_channel(target, grpc.ssl_channel_credentials())
            if secure
            else grpc.aio.insecure_channel(target)
        )
        self._call = self._channel.unary_unary(
            GRPC_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        self._metadata = tuple((k.lower(), v) for k, v in headers.items())
        self._timeout_s = timeout_s

    async def send(self, payload: bytes) -> str:
        try:
            await self._call(payload, timeout=self._timeout_s, metadata=self._metadata, compression=self._grpc.Compression.Gzip)
        except self._grpc.aio.AioRpcError as exc:
            code = exc.code()
            retryable = {
                self._grpc.StatusCode.UNAVAILABLE,
                self._grpc.StatusCode.DEADLINE_EXCEEDED,
                self._grpc.StatusCode.RESOURCE_EXHAUSTED,
                self._grpc.StatusCode.ABORTED,
                self._grpc.StatusCode.CANCELLED,
            }
            log.warning("agl-sidecar: OTLP/gRPC export failed: %s", code)
            return "retry" if code in retryable else "rejected"
        return "ok"

    async def close(self) -> None:
        await self._channel.close()
