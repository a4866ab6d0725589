"""Span export: OTLP/HTTP protobuf (or gRPC), batched by bytes, gzip, retried, spooled to disk.

The hot path only appends encoded span bytes to a queue. A background task frames batches below
`max_batch_bytes` (collectors reject gRPC messages over 4 MiB), compresses them in a worker thread
(zlib releases the GIL) and sends them. While the endpoint is down, batches go to this sidecar's
spool slot (spool.py) as ready-to-send files and are replayed oldest first once a probe succeeds,
with exponential backoff between probes. Memory is bounded: past `max_memory_bytes` pending spans
go to the spool at once.

One bad span never costs another: a batch the endpoint refuses for good (400, 413, any other
non-retryable answer) is split in halves and each half resent, down to the single spans refused
alone, which go to the dead-letter directory (counted: spans_dead_lettered). A spool file the
endpoint keeps answering 5xx while it accepts later files is treated the same way after
`POISON_STRIKES` tries, so it never blocks the files behind it. An OTLP partialSuccess (the
endpoint accepted the request but refused some spans) is counted as spans_rejected and logged; per
the OTLP spec those spans are not resent. Spans that cannot be kept at all (spool full or
unwritable) are counted as failed and logged: never dropped silently.

Guarantee: a span counted in spans_exported was acknowledged (2xx) by the endpoint. A span waiting
in memory (spans_pending) dies with a SIGKILL unless durable mode (durable.py) is on; a span in the
spool (spans_in_spool) survives it.
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
from typing import NamedTuple

import aiohttp

from agl_sidecar.spans import deflate, otlp
from agl_sidecar.spans.durable import SpanLog, read_segment, unknown_delivery
from agl_sidecar.spans.otlp import RequestFramer
from agl_sidecar.spans.spool import SPOOL_SUFFIX, WAL_SUFFIX, Spool, spans_in_name, write_atomic

log = logging.getLogger("agl_sidecar.exporter")

REPEATS = "repeats"  # `compress`: gzip only requests mostly made of prompts sent before
# A prompt sent before counts toward REPEATS from this size: copying a kept deflate stream has a
# fixed cost (the CRC-32 combined in Python, the bytes around it compressed) that sending ~10 KB raw
# beats on loopback, and 180 KB does not (bench/sidecar_export.py with --chars 2000 and 30000).
REPEAT_MIN_BYTES = 32 * 1024

RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
GRPC_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
# A spool file answered 5xx this many times while the endpoint accepted the files after it is
# split like a refused one: its bad span(s) go to the dead-letter directory, the rest is delivered.
POISON_STRIKES = 3


@dataclass
class ExportCounters:
    spans_submitted: int = 0
    spans_exported: int = 0  # acknowledged by the endpoint
    spans_spooled: int = 0
    spans_replayed: int = 0
    spans_failed: int = 0  # lost, each logged
    spans_dead_lettered: int = 0  # refused for good by the endpoint: set aside on disk
    spans_rejected: int = 0  # accepted requests' spans the endpoint refused (OTLP partialSuccess)
    spans_pending: int = 0  # in memory, not yet sent
    spans_sending: int = 0  # in the request being sent now (spooled if it fails)
    spans_in_spool: int = 0  # on disk, waiting for the endpoint
    durable_write_failures: int = 0  # durable mode: spans that could not be logged before the answer
    bytes_exported: int = 0
    bytes_spooled: int = 0
    export_requests: int = 0
    export_errors: int = 0
    spool_files: int = 0
    extra: dict[str, int] = field(default_factory=dict)



class Sent(NamedTuple):
    outcome: str  # "ok", "refused" (not worth retrying), "retry"
    status: int | None = None  # the endpoint's HTTP status; None when it was not reached
    rejected: int = 0  # partialSuccess.rejected_spans of an "ok"
    message: str = ""


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
        compress: bool | str = True,
        durable: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.protocol = protocol
        self.framer = framer
        self.spool_root = Path(spool_dir)
        self.spool = Spool(spool_dir, endpoint or "none", protocol)
        self.headers = dict(headers or {})
        self.max_batch_bytes = max_batch_bytes
        self.max_memory_bytes = max_memory_bytes
        self.max_spool_bytes = max_spool_bytes
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self.compression_level = compression_level
        # True: gzip every request; False: none; REPEATS: gzip a request whose bytes are mostly
        # prompts sent before (their deflate streams are kept, so it costs less than sending them raw).
        self.compress = compress
        self.durable = durable and endpoint is not None
        self.log: SpanLog | None = SpanLog(self.spool) if self.durable else None
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
        self._warned_no_endpoint = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False
        self._in_flight: list[bytes] | None = None  # the batch being sent: spooled if cut short
        # Spans taken from the queue for the spool and not yet written (gzip and the write run in a
        # thread): still counted in spans_pending, or a state read in between would miss them.
        self._spooling = 0
        self._strikes: dict[str, int] = {}  # spool file name -> 5xx answers while later files passed
        self._spool_bytes_now = 0
        self._kept = deflate.KeptStreams()  # shared arrays' deflate streams (touched by the worker only)

    @property
    def spool_dir(self) -> Path:
        """This sidecar's own spool slot."""
        return self.spool.directory

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
        if self.log is not None:
            self.log.append(span)
        self._pending.append(span)
        self._pending_bytes += self.framer.overhead(span)
        self._count_pending()
        self._idle.clear()
        if self._pending_bytes >= self.max_batch_bytes:
            self._wake.set()

    async def sync_durable(self) -> None:
        """Durable mode: return once every span submitted so far is on disk."""
        if self.log is not None:
            await self.log.sync()
            self.counters.durable_write_failures = self.log.write_failures

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self.endpoint is None:
            return
        await asyncio.get_running_loop().run_in_executor(self._pool, self.spool.open)
        await self._recover_span_logs()
        self._refresh_spool_counts()
        if self.counters.spool_files:
            self._idle.clear()  # spans from an earlier run wait to be replayed
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

    async def deliver(self, timeout_s: float) -> bool:
        """Send everything queued so far and wait, up to `timeout_s`, until the endpoint has
        acknowledged it all: nothing pending, nothing in the spool. While the endpoint is down the
        spool is retried every `interval_s` (not after the backoff) until then."""
        if self._task is None:
            return not self._pending and not self.counters.spool_files
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            await self.flush(max(deadline - loop.time(), 0.001))
            if self.delivered:
                return True
            if loop.time() >= deadline:
                return False
            self._next_probe = 0.0  # try the spool now
            self._wake.set()
            await asyncio.sleep(min(self.interval_s, max(deadline - loop.time(), 0.0)))

    @property
    def delivered(self) -> bool:
        """Everything submitted so far was acknowledged by the endpoint (or dead-lettered/failed)."""
        return not self._pending and self._in_flight is None and not self.counters.spool_files

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
        self._spooling += len(self._in_flight or ())  # from sending to pending until spooled
        self._in_flight = None
        self.counters.spans_sending = 0
        self._count_pending()
        if leftover:
            await self._spool_batches(leftover, settle=True)
        if self.log is not None:
            await self.log.close()
        if self._session is not None:
            await self._session.close()
        if self._grpc is not None:
            await self._grpc.close()  # type: ignore[attr-defined]
        self._pool.shutdown(wait=True)
        self.spool.close()

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
                await self._keep_failed_batch()
            if not self._pending and (self.counters.spool_files == 0 or self.down):
                self._idle.set()
                if self._stopping:
                    return

    async def _cycle(self) -> None:
        if self.log is not None:
            await self.log.rotate()  # what is pending now is in closed segments: deletable once settled
        if self._pending_bytes > self.max_memory_bytes:
            await self._spool_batches(self._take_batches(), settle=True)
        if self.counters.spool_files and (time.monotonic() >= self._next_probe or self._stopping and not self.down):
            await self._replay()
        while self._pending:
            if self.down or self.counters.spool_files:
                await self._spool_batches(self._take_batches(), settle=True)  # keep order: older spans first
                return
            batch = self._in_flight = self._next_batch()
            self.counters.spans_sending = len(batch)
            rest = await self._deliver(batch)
            if rest:
                self._mark_down()
                await self._spool_batches([rest])
            self._in_flight = None
            self.counters.spans_sending = 0
            self._settle(len(batch))

    async def _keep_failed_batch(self) -> None:
        """After a cycle died of something unplanned (a header aiohttp will not send, a bug), the
        batch it was sending goes to the spool (or counts as failed), never overwritten by the next
        cycle's: replayed after the backoff, it is delivered once the cause is gone, and meanwhile
        counted in spans_in_spool. Parts the endpoint had already acknowledged may arrive twice."""
        batch, self._in_flight = self._in_flight, None
        self.counters.spans_sending = 0
        if not batch:
            return
        self._mark_down()
        try:
            await self._spool_batches([batch])
        except Exception as exc:  # the spool path itself is what broke
            self._fail(len(batch), f"the export cycle failed and the batch cannot be spooled: {exc!r}")
        self._settle(len(batch))

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
        self._count_pending()
        return batch

    def _take_batches(self) -> list[list[bytes]]:
        """Every pending span, in export requests of at most max_batch_bytes each."""
        spans = list(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        self._spooling += len(spans)  # counted as pending until _spool_batches has written them
        self._count_pending()
        return self._batches(spans)

    def _count_pending(self) -> None:
        self.counters.spans_pending = len(self._pending) + self._spooling

    def _batches(self, spans: list[bytes]) -> list[list[bytes]]:
        """`spans` in order, cut into requests of at most max_batch_bytes (a bigger span goes alone)."""
        batches: list[list[bytes]] = []
        batch: list[bytes] = []
        size = 0
        for span in spans:
            cost = self.framer.overhead(span)
            if batch and size + cost > self.max_batch_bytes:
                batches.append(batch)
                batch, size = [], 0
            batch.append(span)
            size += cost
        if batch:
            batches.append(batch)
        return batches

    def _settle(self, spans: int) -> None:
        if self.log is not None:
            self.log.settle(spans)

    def _gzips(self, batch: Sequence[bytes]) -> bool:
        """Whether the request for `batch` is gzipped."""
        if self.compress != REPEATS:
            return bool(self.compress)
        shared = sum(
            len(array.elements)
            for span in batch
            if type(span) is otlp.SharedSpan
            for _, array in span.shared
            if len(array.elements) >= REPEAT_MIN_BYTES
        )
        return shared > 0 and 2 * shared >= sum(len(span) for span in batch)

    async def _encode(self, batch: Sequence[bytes], gzipped: bool) -> bytes:
        """The request body for `batch`: gzipped (in the worker thread, a prompt sent again
        compressed once: deflate.py) or not."""
        if self.protocol == "grpc" or not gzipped:
            return self.framer.request(batch)
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, deflate.gzip_spans, self.framer, batch, self.compression_level, self._kept
        )

    async def _gzip(self, data: bytes) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(self._pool, gzip.compress, data, self.compression_level)

    async def _deliver(self, spans: list[bytes], refuse_5xx: bool = False) -> list[bytes]:
        """Send `spans`; a request refused for good is split in halves
        until the spans refused alone are found and set aside. Returns the spans still to send when
        the endpoint stopped answering (empty: every span acknowledged, rejected or set aside).
        `refuse_5xx`: treat a 5xx as a refusal (a file that fails while others pass)."""
        stack = [spans]
        while stack:
            part = stack.pop()
            gzipped = self._gzips(part)
            sent = await self._send(await self._encode(part, gzipped), gzipped)
            refused = sent.outcome == "refused" or (refuse_5xx and sent.outcome == "retry" and sent.status is not None)
            if sent.outcome == "ok":
                self.counters.spans_exported += len(part) - min(sent.rejected, len(part))
                if sent.rejected:
                    self.counters.spans_rejected += sent.rejected
                    log.error("agl-sidecar: the endpoint refused %d of %d span(s) in an accepted request: %s",
                              sent.rejected, len(part), sent.message or "(no message)")
            elif not refused:
                return part + [span for later in reversed(stack) for span in later]
            elif len(part) == 1:
                await self._dead_letter(part, f"HTTP {sent.status}: {sent.message}")
            else:
                middle = len(part) // 2
                stack.append(part[middle:])
                stack.append(part[:middle])
        return []

    async def _send(self, payload: bytes, compressed: bool = True) -> Sent:
        self.counters.export_requests += 1
        if self._grpc is not None:
            outcome = await self._grpc.send(payload)  # type: ignore[attr-defined]
            if outcome != "ok":
                self.counters.export_errors += 1
                return Sent("refused" if outcome == "rejected" else "retry", None if outcome == "retry" else 400)
            self.counters.bytes_exported += len(payload)
            return Sent("ok")
        assert self._session is not None and self.endpoint is not None
        headers = {"content-type": "application/x-protobuf", **self.headers}
        if compressed:
            headers["content-encoding"] = "gzip"
        try:
            async with self._session.post(traces_url(self.endpoint), data=payload, headers=headers) as response:
                body = await response.read()
                status = response.status
                json_body = "json" in response.headers.get("content-type", "")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.counters.export_errors += 1
            log.warning("agl-sidecar: OTLP endpoint %s unreachable: %s", self.endpoint, exc)
            return Sent("retry")
        if 200 <= status < 300:
            self.counters.bytes_exported += len(payload)
            rejected, message = otlp.partial_success(body, json_body)
            return Sent("ok", status, rejected, message)
        self.counters.export_errors += 1
        message = body[:300].decode(errors="replace")
        if status in RETRYABLE_STATUS:
            log.warning("agl-sidecar: OTLP endpoint answered %s; spooling and retrying", status)
            return Sent("retry", status, message=message)
        log.error("agl-sidecar: OTLP endpoint refused a request with HTTP %s: %s", status, message)
        return Sent("refused", status, message=message)

    def _mark_down(self) -> None:
        if not self.down:
            log.warning("agl-sidecar: OTLP endpoint down; spooling spans to %s", self.spool_dir)
        self.down = True
        self._next_probe = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)

    async def _replay(self) -> None:
        suspects: list[Path] = []  # files answered 5xx this round: the endpoint may still take later ones
        for path in self.spool.files():
            try:
                payload = path.read_bytes()
            except OSError as exc:
                log.error("agl-sidecar: cannot read spool file %s: %s", path, exc)
                continue
            spans = spans_in_name(path)
            if self.protocol == "grpc":  # gRPC compresses on its own; HTTP sends the file as it is
                payload = gzip.decompress(payload)
            sent = await self._send(payload)
            if sent.outcome == "retry":
                if sent.status is None or suspects:  # unreachable, or two files in a row failed
                    self._strike_out(suspects, passed=False)
                    self._mark_down()
                    return
                suspects.append(path)
                continue
            self._strike_out(suspects, passed=True)
            suspects = []
            if sent.outcome == "ok":
                self._replayed(spans - min(sent.rejected, spans), sent)
            elif not await self._replay_split(path, f"HTTP {sent.status}", refuse_5xx=False):
                return
            path.unlink(missing_ok=True)
        if suspects:
            self._strike_out(suspects, passed=False)
            self._mark_down()
            self._refresh_spool_counts()
            return
        for path in self.spool.files():  # files that failed POISON_STRIKES times while others passed
            if self._strikes.get(path.name, 0) >= POISON_STRIKES:
                if not await self._replay_split(path, "repeated 5xx", refuse_5xx=True):
                    return
                self._strikes.pop(path.name, None)
                path.unlink(missing_ok=True)
        if self.down:
            log.warning("agl-sidecar: OTLP endpoint is back; spool replayed")
        self.down = False
        self._backoff_s = 0.5
        self._refresh_spool_counts()

    def _strike_out(self, suspects: list[Path], passed: bool) -> None:
        """Files answered 5xx: a strike each when a later file passed (the endpoint works, they do not)."""
        for path in suspects:
            if passed:
                self._strikes[path.name] = self._strikes.get(path.name, 0) + 1
                log.error("agl-sidecar: the endpoint answers 5xx to spool file %s but takes others (%d of %d tries)",
                          path.name, self._strikes[path.name], POISON_STRIKES)

    def _replayed(self, spans: int, sent: Sent) -> None:
        self.counters.spans_exported += spans
        self.counters.spans_replayed += spans
        if sent.rejected:
            self.counters.spans_rejected += sent.rejected
            log.error("agl-sidecar: the endpoint refused %d span(s) of a replayed request: %s", sent.rejected, sent.message)

    async def _replay_split(self, path: Path, why: str, refuse_5xx: bool) -> bool:
        """Deliver a refused spool file span set by span set; False (file rewritten with what is left)
        when the endpoint stopped answering meanwhile."""
        try:
            spans = otlp.split_request(gzip.decompress(path.read_bytes()))
        except (ValueError, OSError, EOFError, gzip.BadGzipFile) as exc:
            await self._dead_letter_file(path, f"{why}; and the file cannot be read back: {exc}")
            return True
        log.error("agl-sidecar: spool file %s (%d spans) refused (%s); resending it in parts", path.name, len(spans), why)
        exported_before = self.counters.spans_exported
        rest = await self._deliver(spans, refuse_5xx=refuse_5xx)
        self.counters.spans_replayed += self.counters.spans_exported - exported_before
        if rest:
            payload = await self._gzip(self.framer.request(rest))
            renamed = path.with_name(path.name[: -len(SPOOL_SUFFIX)].rsplit("-", 1)[0] + f"-{len(rest)}{SPOOL_SUFFIX}")
            await asyncio.get_running_loop().run_in_executor(self._pool, write_atomic, renamed, payload)
            if renamed != path:
                path.unlink(missing_ok=True)
            self._mark_down()
            self._refresh_spool_counts()
            return False
        return True

    async def _dead_letter(self, spans: list[bytes], why: str) -> None:
        payload = await self._gzip(self.framer.request(spans))
        try:
            where = await asyncio.get_running_loop().run_in_executor(
                self._pool, self.spool.dead_letter, payload, len(spans), why
            )
        except OSError as exc:
            self._fail(len(spans), f"refused by the endpoint ({why}) and cannot be set aside: {exc}")
            return
        self.counters.spans_dead_lettered += len(spans)
        log.error("agl-sidecar: %d span(s) refused by the endpoint for good (%s); set aside in %s", len(spans), why, where)

    async def _dead_letter_file(self, path: Path, why: str) -> None:
        spans = spans_in_name(path)
        self.spool.dead_letter_dir.mkdir(parents=True, exist_ok=True)
        os.replace(path, self.spool.dead_letter_dir / path.name)
        (self.spool.dead_letter_dir / (path.name + ".why.txt")).write_text(why + "\n")
        self.counters.spans_dead_lettered += spans
        log.error("agl-sidecar: spool file %s set aside in %s: %s", path.name, self.spool.dead_letter_dir, why)

    async def _spool_batches(self, batches: list[list[bytes]], settle: bool = False) -> None:
        """Write batches to the spool; `settle`: they came from the pending queue (durable log order;
        _take_batches counted them as spooling)."""
        unwritten = sum(len(batch) for batch in batches) if settle else 0
        try:
            for batch in batches:
                await self._write_spool(await self._gzip(self.framer.request(batch)), len(batch))
                if settle:
                    unwritten -= len(batch)
                    self._spooling -= len(batch)
                    self._count_pending()
                    self._settle(len(batch))
        except Exception as exc:  # taken off the queue and not written: lost, so counted
            if settle and unwritten:
                self._fail(unwritten, f"cannot be spooled: {exc!r}")
                self._settle(unwritten)
            raise
        finally:  # cancelled part-way: the count must not stay inflated
            self._spooling -= unwritten
            self._count_pending()

    async def _write_spool(self, payload: bytes, spans: int) -> None:
        if self._spool_bytes_now + len(payload) > self.max_spool_bytes:
            self._spool_bytes_now = self.spool.bytes()
            if self._spool_bytes_now + len(payload) > self.max_spool_bytes:
                self._fail(spans, f"spool {self.spool_dir} is full ({self.max_spool_bytes} bytes)")
                return
        path = self.spool.new_name(SPOOL_SUFFIX, spans)
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, write_atomic, path, payload)
        except OSError as exc:
            self._fail(spans, f"cannot write spool file {path}: {exc}")
            try:
                path.with_name(path.name + ".tmp").unlink(missing_ok=True)
            except OSError:
                pass
            return
        self._spool_bytes_now += len(payload)
        self.counters.spans_spooled += spans
        self.counters.bytes_spooled += len(payload)
        self.counters.spool_files += 1
        self.counters.spans_in_spool += spans

    def _refresh_spool_counts(self) -> None:
        files = self.spool.files()
        self.counters.spool_files = len(files)
        self.counters.spans_in_spool = sum(spans_in_name(path) for path in files)
        self._spool_bytes_now = self.spool.bytes()

    async def _recover_span_logs(self) -> None:
        """Durable-mode log segments a killed sidecar left: their spans become spool files; a call
        span without its delivery marker says its delivery is unknown (durable.unknown_delivery)."""
        segments = self.spool.files(WAL_SUFFIX)
        delivered: set[bytes] = set()  # markers may sit in a later segment than their spans
        read: list[tuple[Path, list[bytes]]] = []
        for segment in segments:
            try:
                read.append((segment, list(read_segment(segment, delivered))))
            except OSError as exc:
                log.error("agl-sidecar: cannot read span log %s: %s", segment, exc)
        for segment, found in read:
            spans = [unknown_delivery(span, delivered) for span in found]
            await self._spool_batches(self._batches(spans))
            if spans:
                unknown = sum(after is not before for after, before in zip(spans, found, strict=True))
                log.warning("agl-sidecar: recovered %d span(s) of answered calls from %s (%d whose last bytes "
                            "may not have reached the harness: marked delivery unknown)", len(spans), segment.name,
                            unknown)  # fmt: skip
            segment.unlink(missing_ok=True)

    def _fail(self, spans: int, why: str) -> None:
        self.counters.spans_failed += spans
        log.error("agl-sidecar: %d span(s) lost: %s (%d lost so far)", spans, why, self.counters.spans_failed)


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
