"""`Receiver`: the trainer's OTLP endpoint (HTTP protobuf/JSON on /v1/traces and /v1/logs, and gRPC).

    receiver = Receiver("runs/x/rollouts.db", ReceiverConfig(port=0, grpc_port=0)).start()
    receiver.url           # http://127.0.0.1:PORT (an OTLP/HTTP base URL; POST /v1/traces)
    receiver.grpc_address  # 127.0.0.1:PORT (OTLP/gRPC), or None
    receiver.stats()       # ReceiverStats
    receiver.stop()

It runs on its own thread and event loop, so a synchronous training loop can own one. A request is
answered 200 only after its spans are committed to the store (see RolloutStore for durability).
Logs carry one thing agl reads: the GenAI semconv's `gen_ai.evaluation.result` event, a reward
(otlp_logs.py); every other log record is acknowledged and ignored.
Also served: GET /stats (JSON), GET /metrics (Prometheus), GET /healthz.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Self

import msgspec

from agl_trainer.background_loop import BackgroundLoop
from agl_trainer.receiver.arrival import Arrivals
from agl_trainer.receiver.deadlines import ByteBudget, DeadlineSite, HeaderDeadline
from agl_trainer.receiver.payload import (
    JSON,
    DecodedBatch,
    PayloadTooLarge,
    decode_body,
    decode_logs_body,
    decompress,
    media_type,
)
from agl_trainer.receiver.stats import ReceiverStats, StatsCounter, prometheus
from agl_trainer.receiver.wire import DecodeError
from agl_trainer.receiver.writer import StoreWriter
from agl_trainer.store.records import WriteResult
from agl_trainer.store.rollout_store import RolloutStore

log = logging.getLogger("agl.receiver")

TRACES_PATH = "/v1/traces"
LOGS_PATH = "/v1/logs"
GRPC_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
GRPC_LOGS_SERVICE = "opentelemetry.proto.collector.logs.v1.LogsService"
MiB = 1 << 20
LINGER_S = 1.0
BODIES_AT_ONCE = 4  # request bodies of the largest size held at once (smaller ones: more)


class ReceiverConfig(msgspec.Struct, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 4318  # 0: any free port
    grpc_host: str = "127.0.0.1"
    grpc_port: int | None = None  # None: no gRPC; 0: any free port
    token: str | None = None  # when set, requests need `authorization: Bearer <token>`
    max_request_bytes: int = 64 * MiB  # as sent (compressed)
    max_decompressed_bytes: int = 256 * MiB
    durability: str = "full"  # see RolloutStore
    header_timeout_s: float = 30.0  # a connection without a whole request head by then is closed
    body_timeout_s: float = 120.0  # a body not all arrived by then (after its head) is a 408

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_decompressed_bytes", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ReceiverConfig.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"ReceiverConfig.port must be 0..65535, got {self.port}")


class RequestRefused(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class Receiver:
    def __init__(self, store: str | Path | RolloutStore, config: ReceiverConfig | None = None) -> None:
        self.config = config or ReceiverConfig()
        if isinstance(store, RolloutStore):
            self._store, self._owns_store = store, False
        else:
            self._store, self._owns_store = RolloutStore(store, durability=self.config.durability), True
        self._writer = StoreWriter(self._store)
        self._counter = StatsCounter()
        self._arrivals = Arrivals()  # a reward cannot have ended after it arrived (arrival.py)
        self._decoders = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agl-otlp-decode")
        self._warned: dict[str, int] = {}
        self._http = BackgroundLoop("agl-receiver")
        self._runner = None
        self._grpc = None
        self.url: str | None = None
        self.grpc_address: str | None = None

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> Receiver:
        self._writer.start()
        try:
            self._http.start(self._start_http, lambda: self._runner.cleanup())
        except BaseException:
            self._writer.stop()
            raise
        if self.config.grpc_port is not None:
            self._start_grpc()
        return self

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=1.0).wait()
            self._grpc = None
        self._http.stop(timeout_s=10)  # the HTTP server is cleaned up on its loop first
        self._writer.stop()
        self._decoders.shutdown(wait=True)
        if self._owns_store:
            self._store.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> ReceiverStats:
        return self._counter.snapshot()

    # --- shared ingest path -------------------------------------------------------------------
    def _decode(self, body: bytes, media: str, encoding: str | None, logs: bool = False) -> DecodedBatch:
        try:
            plain = decompress(body, encoding, self.config.max_decompressed_bytes)
            batch = decode_logs_body(plain, media) if logs else decode_body(plain, media)
            return msgspec.structs.replace(batch, records=self._arrivals.settle(batch.records))
        except PayloadTooLarge as error:
            raise RequestRefused(413, "too_large", str(error)) from None
        except DecodeError as error:
            raise RequestRefused(400, "malformed", f"malformed OTLP payload: {error}") from None
        except Exception as error:  # noqa: BLE001 (a decoder bug must not become a 5xx the sender retries forever)
            log.exception("could not decode a request (a receiver bug: please report it)")
            raise RequestRefused(
                400, "undecodable", f"the receiver could not decode this request: {type(error).__name__}"
            ) from None

    def _account(self, batch: DecodedBatch, result: WriteResult) -> None:
        self._counter.accepted(
            batch.spans,
            batch.foreign,
            result.stored,
            result.duplicates,
            result.tokens,
            result.violations,
            batch.log_records,
        )
        for reason, count in result.violations.items():
            seen = self._warned.get(reason, 0)
            self._warned[reason] = seen + count
            if seen == 0 or (seen + count) // 1000 > seen // 1000:
                log.warning(
                    "spans breaking the contract: %s (%d so far); kept, not trained on", reason, seen + count
                )

    def _check_token(self, header: str | None) -> None:
        token = self.config.token
        if token is None:
            return
        expected = f"Bearer {token}".encode()
        if header is None or not hmac.compare_digest(_header_bytes(header), expected):
            raise RequestRefused(
                401, "unauthorized", "missing or wrong bearer token (authorization: Bearer ...)"
            )

    # --- OTLP/HTTP ----------------------------------------------------------------------------
    async def _start_http(self) -> None:
        from aiohttp import web

        self._bodies = ByteBudget(BODIES_AT_ONCE * self.config.max_request_bytes)
        self._deadline = HeaderDeadline(self.config.header_timeout_s, lambda: self._counter.refused("header_timeout"))
        app = web.Application(client_max_size=self.config.max_request_bytes, middlewares=[self._deadline.middleware()])
        app.router.add_post(TRACES_PATH, self._http_export)
        app.router.add_post(LOGS_PATH, self._http_export_logs)
        app.router.add_get("/stats", self._http_stats)
        app.router.add_get("/metrics", self._http_metrics)
        app.router.add_get("/healthz", self._http_health)
        from agl_trainer.receiver.client_errors import quiet_client_errors

        quiet_client_errors()  # a sender's malformed HTTP is its 400, not a traceback in our log
        # lingering_time: after an answer that ends a connection (408, 413) aiohttp reads what the
        # sender still sends, 10 s by default: a sender that sends nothing held it that long.
        self._runner = web.AppRunner(
            app, handle_signals=False, access_log=None, auto_decompress=False, lingering_time=LINGER_S
        )
        await self._runner.setup()
        site = DeadlineSite(self._runner, self.config.host, self.config.port, self._deadline)
        await site.start()
        host, port = site._server.sockets[0].getsockname()[:2]  # type: ignore[union-attr]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{port}"

    async def _http_export(self, request):
        return await self._held_export(request, logs=False)

    async def _http_export_logs(self, request):
        return await self._held_export(request, logs=True)

    async def _held_export(self, request, logs: bool):
        held: list[int] = []  # body bytes reserved from the budget, given back once answered
        try:
            return await self._export(request, held, logs)
        finally:
            if held:
                self._bodies.give(held[0])

    async def _export(self, request, held: list[int], logs: bool):
        from aiohttp import web

        media = media_type(request.headers.get("content-type"))
        try:
            self._check_token(request.headers.get("authorization"))
            if media is None:
                raise RequestRefused(
                    415,
                    "content_type",
                    f"unsupported content-type {request.headers.get('content-type')!r};"
                    " send application/x-protobuf or application/json",
                )
            if (request.content_length or 0) > self.config.max_request_bytes:
                raise RequestRefused(
                    413, "too_large", f"body over the limit of {self.config.max_request_bytes} bytes"
                )
            reserved = min(request.content_length or self.config.max_request_bytes, self.config.max_request_bytes)
            await self._bodies.take(reserved)  # bodies held at once are bounded (deadlines.ByteBudget)
            held.append(reserved)
            try:
                body = await asyncio.wait_for(self._read_body(request), self.config.body_timeout_s)
            except TimeoutError:
                raise RequestRefused(
                    408, "body_timeout", f"the body did not all arrive within {self.config.body_timeout_s:g} s"
                ) from None
            except ConnectionError:
                # The sender went away mid-body (a sidecar stopping while it exports): nothing was
                # acknowledged, so it sends the batch again (or spooled it); nothing to store here.
                self._counter.refused("sender_disconnected")
                log.info("a sender closed its connection before its batch arrived; it will resend it")
                return web.Response(status=400)
            self._counter.request(len(body))
            loop = asyncio.get_running_loop()
            batch = await loop.run_in_executor(
                self._decoders, self._decode, body, media, request.headers.get("content-encoding"), logs
            )
            try:
                result = await asyncio.wrap_future(self._writer.submit(batch.records))
            except Exception as error:  # noqa: BLE001 (any store failure is a retryable 503)
                log.error("could not store a batch: %s", error)
                raise RequestRefused(503, "store_error", f"the store could not commit: {error}") from None
        except RequestRefused as refused:
            self._counter.refused(f"{refused.status}_{refused.kind}")
            headers = {"retry-after": "1"} if refused.status == 503 else None
            response = web.json_response(
                {"code": _GRPC_CODES[refused.status], "message": refused.message},
                status=refused.status,
                headers=headers,
            )
            if refused.status in (408, 413):  # the rest of the body is not read: the connection ends here
                response.force_close()
            return response
        self._account(batch, result)
        rejected = sum(result.violations.values())
        return web.Response(body=_export_response(media, rejected, result, logs), content_type=media or JSON)

    async def _read_body(self, request) -> bytearray:
        """The body into one buffer of its announced size (aiohttp's read() holds it twice)."""
        limit = self.config.max_request_bytes
        size = request.content_length
        buffer = bytearray(size if size is not None and size <= limit else 0)
        filled = 0
        while True:
            chunk = await request.content.readany()
            if not chunk:
                break
            end = filled + len(chunk)
            if end > limit:
                raise RequestRefused(413, "too_large", f"body over the limit of {limit} bytes")
            if end > len(buffer):
                buffer.extend(bytes(min(limit, max(end, 2 * len(buffer))) - len(buffer)))
            buffer[filled:end] = chunk
            filled = end
        del buffer[filled:]
        return buffer

    async def _http_stats(self, request):
        from aiohttp import web

        return web.Response(body=msgspec.json.encode(self.stats()), content_type="application/json")

    async def _http_metrics(self, request):
        from aiohttp import web

        return web.Response(text=prometheus(self.stats()), content_type="text/plain")

    async def _http_health(self, request):
        from aiohttp import web

        return web.json_response({"status": "ok"})

    # --- OTLP/gRPC ----------------------------------------------------------------------------
    def _start_grpc(self) -> None:
        import grpc

        options = [
            ("grpc.max_receive_message_length", self.config.max_request_bytes),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.server(
            ThreadPoolExecutor(max_workers=8, thread_name_prefix="agl-grpc"), options=options
        )
        traces = grpc.unary_unary_rpc_method_handler(
            self._grpc_export, request_deserializer=None, response_serializer=None
        )
        logs = grpc.unary_unary_rpc_method_handler(
            self._grpc_export_logs, request_deserializer=None, response_serializer=None
        )
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(GRPC_SERVICE, {"Export": traces}),
                grpc.method_handlers_generic_handler(GRPC_LOGS_SERVICE, {"Export": logs}),
            )
        )
        port = server.add_insecure_port(f"{self.config.grpc_host}:{self.config.grpc_port}")
        if port == 0:
            raise OSError(f"could not listen for gRPC on {self.config.grpc_host}:{self.config.grpc_port}")
        server.start()
        self._grpc = server
        self.grpc_address = f"{self.config.grpc_host}:{port}"

    def _grpc_export_logs(self, body: bytes, context) -> bytes:
        return self._grpc_export(body, context, logs=True)

    def _grpc_export(self, body: bytes, context, logs: bool = False) -> bytes:
        import grpc

        codes = {
            400: grpc.StatusCode.INVALID_ARGUMENT,
            401: grpc.StatusCode.UNAUTHENTICATED,
            413: grpc.StatusCode.RESOURCE_EXHAUSTED,
            503: grpc.StatusCode.UNAVAILABLE,
        }
        try:
            metadata = dict(context.invocation_metadata())
            self._check_token(metadata.get("authorization"))
            self._counter.request(len(body))
            batch = self._decode(body, "application/x-protobuf", None, logs)
            try:
                result = self._writer.submit(batch.records).result()
            except Exception as error:  # noqa: BLE001 (any store failure is a retryable UNAVAILABLE)
                raise RequestRefused(503, "store_error", f"the store could not commit: {error}") from None
        except RequestRefused as refused:
            self._counter.refused(f"grpc_{refused.kind}")
            context.abort(codes[refused.status], refused.message)
            raise  # abort raises; this keeps type checkers calm
        self._account(batch, result)
        return _export_response("application/x-protobuf", sum(result.violations.values()), result, logs)


def _header_bytes(value: str) -> bytes:
    """A header value as the bytes that were sent: aiohttp keeps bytes that are not UTF-8 as
    surrogate escapes (a raw 0xFF must compare unequal, never raise)."""
    return value.encode("utf-8", "surrogateescape")


_GRPC_CODES = {400: 3, 401: 16, 408: 4, 413: 8, 415: 3, 503: 14}  # google.rpc.Code for the JSON error body


def _export_response(media: str, rejected: int, result: WriteResult, logs: bool = False) -> bytes:
    """An Export*ServiceResponse: empty, or a partial success naming what was rejected and why."""
    message = ""
    if rejected:
        reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(result.violations.items()))
        what = "evaluation result(s)" if logs else "span(s)"
        message = f"{rejected} {what} break the agl span contract and will not be trained on ({reasons})"
    if media == JSON:
        if not rejected:
            return b"{}"
        key = "rejectedLogRecords" if logs else "rejectedSpans"
        return msgspec.json.encode({"partialSuccess": {key: str(rejected), "errorMessage": message}})
    if logs:
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse

        response: Any = ExportLogsServiceResponse()
        if rejected:
            response.partial_success.rejected_log_records = rejected
    else:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        response = ExportTraceServiceResponse()
        if rejected:
            response.partial_success.rejected_spans = rejected
    if rejected:
        response.partial_success.error_message = message
    return response.SerializeToString()
