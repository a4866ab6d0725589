"""Put spans into a store the way the receiver does (decode the real protobuf bytes, classify, write)."""

from __future__ import annotations

from collections.abc import Iterable

from agl_trainer.receiver import decode_body
from agl_trainer.store import RolloutStore
from agl_trainer.store.records import WriteResult
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.dataplane.otlp import request


def ingest(store: RolloutStore, spans: Iterable[Span]) -> WriteResult:
    batch = decode_body(request(spans).SerializeToString(), "application/x-protobuf")
    return store.write(batch.records)
