"""An OTLP/HTTP receiver that refuses some requests the way real receivers do.

It decodes every request with opentelemetry-proto (a request protobuf cannot parse gets 400, like a
collector) and refuses, with `refuse_status`, every request that holds a span `is_poison` picks:
one bad span makes the whole request fail, which is what a receiver with a per-request transaction
does. Accepted spans are kept; `partial` makes it answer an OTLP partialSuccess instead.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.support.otlp_sink import any_value


def attributes(span: Span) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in span.attributes}


def rollout_of(span: Span) -> Any:
    return attributes(span).get("agl.rollout.id")


class RefusingSink:
    def __init__(
        self,
        is_poison: Callable[[Span], bool] = lambda span: False,
        refuse_status: int = 400,
        partial: bool = False,
    ) -> None:
        self.is_poison = is_poison
        self.refuse_status = refuse_status
        self.partial = partial
        self.down_with: int | None = None  # answer every request with this (an outage)
        self.spans: list[Span] = []
        self.requests = 0
        self.refused = 0
        self._cond = threading.Condition()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                with sink._cond:
                    sink.requests += 1
                if sink.down_with is not None:
                    return self._answer(sink.down_with, b"down")
                request = ExportTraceServiceRequest()
                try:
                    request.ParseFromString(body)
                except DecodeError as exc:
                    return self._answer(400, f"cannot decode: {exc}".encode())
                spans = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
                bad = [s for s in spans if sink.is_poison(s)]
                reply = ExportTraceServiceResponse()
                if bad and not sink.partial:
                    with sink._cond:
                        sink.refused += 1
                    return self._answer(sink.refuse_status, b"a span in this request is refused")
                if bad:
                    reply.partial_success.rejected_spans = len(bad)
                    reply.partial_success.error_message = "bad span"
                with sink._cond:
                    sink.spans += [s for s in spans if not sink.is_poison(s)]
                    sink._cond.notify_all()
                self._answer(200, reply.SerializeToString())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def wait_for(self, predicate: Callable[[list[Span]], bool], timeout: float = 15.0) -> list[Span]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.spans):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out; have {len(self.spans)} span(s), {self.requests} request(s)")
                self._cond.wait(remaining)
            return list(self.spans)

    def __enter__(self) -> RefusingSink:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
