"""A real OTLP/HTTP receiver for tests: decodes ExportTraceServiceRequest protobuf (or JSON) with
opentelemetry-proto and keeps every span, so tests assert on what actually went over the wire.

It can also refuse the way real receivers do: a request it cannot decode gets 400 (like a
collector); `fail_with` answers every request with that status (an outage); `refuse` picks spans
that make their whole request fail with `refuse_status` (a receiver with a per-request
transaction), or, with `partial`, get dropped and counted in an OTLP partialSuccess.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from agl import semconv


def any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status_code: int
    raw_attribute_kinds: dict[str, str] = field(default_factory=dict)

    @property
    def rollout_id(self) -> Any:
        return self.attributes.get(semconv.ROLLOUT_ID)


def received_span(span: Span, resource: dict[str, Any]) -> ReceivedSpan:
    return ReceivedSpan(
        name=span.name,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        kind=span.kind,
        attributes={kv.key: any_value(kv.value) for kv in span.attributes},
        resource=resource,
        status_code=span.status.code,
        raw_attribute_kinds={kv.key: kv.value.WhichOneof("value") or "" for kv in span.attributes},
    )


class OTLPSink:
    """`with OTLPSink() as sink:` listens on 127.0.0.1; `sink.endpoint` is the base URL."""

    def __init__(
        self,
        fail_with: int | None = None,
        refuse: Callable[[ReceivedSpan], bool] = lambda span: False,
        refuse_status: int = 400,
        partial: bool = False,
    ) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self.encodings: list[str] = []  # each request's Content-Encoding, in order
        self.refused = 0  # requests refused for a span `refuse` picked
        self.fail_with = fail_with  # answer every request with this status (to simulate an outage)
        self.refuse = refuse
        self.refuse_status = refuse_status
        self.partial = partial
        self._cond = threading.Condition()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                sink.encodings.append(self.headers.get("content-encoding") or "identity")
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if sink.fail_with is not None:
                    with sink._cond:
                        sink.requests += 1
                    return self._answer(sink.fail_with, b"")
                request = ExportTraceServiceRequest()
                try:
                    if "json" in self.headers.get("content-type", ""):
                        json_format.Parse(body, request)
                    else:
                        request.ParseFromString(body)
                except (DecodeError, json_format.ParseError) as exc:
                    with sink._cond:
                        sink.requests += 1
                    return self._answer(400, f"cannot decode: {exc}".encode())
                reply = ExportTraceServiceResponse()
                refused = sink._add(request)
                if refused and not sink.partial:
                    return self._answer(sink.refuse_status, b"a span in this request is refused")
                if refused:
                    reply.partial_success.rejected_spans = refused
                    reply.partial_success.error_message = "refused span"
                self._answer(200, reply.SerializeToString())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _add(self, request: ExportTraceServiceRequest) -> int:
        """Keep the request's spans unless `refuse` picks one; the number of refused spans."""
        spans = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: any_value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                spans += [received_span(span, resource) for span in scope_spans.spans]
        kept = [span for span in spans if not self.refuse(span)]
        refused = len(spans) - len(kept)
        with self._cond:
            self.requests += 1
            if refused and not self.partial:
                self.refused += 1
                return refused
            self.spans += kept
            self._cond.notify_all()
        return refused

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 10.0
    ) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.spans):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out waiting for spans; have {[s.name for s in self.spans]}")
                self._cond.wait(remaining)
            return list(self.spans)

    def named(self, name: str) -> list[ReceivedSpan]:
        with self._cond:
            return [span for span in self.spans if span.name == name]

    def __enter__(self) -> OTLPSink:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()


class RecorderSpans:
    """In place of the sidecar's exporter, for a SpanRecorder (`submit`, `counters`): keeps the
    encoded spans it is handed, and reads them back as (name, attributes)."""

    def __init__(self) -> None:
        from agl_sidecar.spans.exporter import ExportCounters

        self.spans: list[bytes] = []
        self.counters = ExportCounters()

    def submit(self, span: bytes) -> None:
        self.spans.append(span)

    def decoded(self) -> list[tuple[str, dict[str, Any]]]:
        from agl_sidecar.spans import otlp

        if not self.spans:
            return []
        request = ExportTraceServiceRequest()
        request.ParseFromString(otlp.RequestFramer({"service.name": "t"}, "agl", "0").request(self.spans))
        spans = request.resource_spans[0].scope_spans[0].spans
        return [(s.name, {kv.key: any_value(kv.value) for kv in s.attributes}) for s in spans]
