"""The sidecar's account of a call (agl.call.held_ms, agl.call.upstream, agl.call.api) from its span
encoder through the receiver to the store and the viewer's API; bad values refused naming the
attribute; a schema-3 store gains the columns in place and keeps its rows."""

from __future__ import annotations

import math
import sqlite3
import time
from typing import Any

import httpx
import msgspec
import pytest
from agl import semconv
from agl_sidecar.calls.attribution import Identity
from agl_sidecar.spans import otlp
from agl_sidecar.calls.record import CallRecord
from agl_sidecar.spans.recorder import SpanRecorder
from agl_trainer.store import RolloutStore
from agl_trainer.store.schema import SCHEMA_VERSION
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import call_span, request, rollout_span, with_attributes
from tests.support.otlp_sink import RecorderSpans
from tests.viewer.conftest import get, start

PROTOBUF = {"content-type": "application/x-protobuf"}
UPSTREAM = "http://10.0.0.7:8000"


async def sidecar_request(rollout_id: str, **record: Any) -> bytes:
    """An OTLP request as the sidecar sends it: a call held 37.25 ms (`record` sets more of its
    CallRecord), then the rollout's end."""
    collector = RecorderSpans()
    recorder = SpanRecorder(collector)  # type: ignore[arg-type]
    recorder.start()
    identity = Identity(rollout_id=rollout_id, task_id="t", attempt=0, mode=semconv.MODE_TRAIN)
    call = CallRecord(api=semconv.API_ANTHROPIC_MESSAGES, operation="chat", identity=identity, trace_parent=None,
                      start_ns=time.time_ns(), model="tiny", policy_version=0,
                      **{"held_ms": 37.25, "upstream": UPSTREAM, **record})  # fmt: skip
    call.prompt_ids = msgspec.Raw(b"[1,2,3]")
    choice = call.choice(0)
    choice.token_ids = msgspec.Raw(b"[7]")
    choice.logprobs = msgspec.Raw(b'{"content":[{"logprob":-0.25}]}')
    call.seq = recorder.next_seq(call.identity)
    recorder.finish(call)
    recorder.rollout_end(identity, semconv.STATUS_SUCCEEDED, None)
    assert await recorder.drain(10)
    await recorder.close()
    return otlp.RequestFramer({"service.name": "agl-sidecar"}, "agl", "0").request(collector.spans)


def post(receiver, body: bytes) -> ExportTraceServiceResponse:
    reply = httpx.post(f"{receiver.url}/v1/traces", content=body, headers=PROTOBUF, timeout=30)
    assert reply.status_code == 200
    return ExportTraceServiceResponse.FromString(reply.content)


async def test_a_held_call_from_the_sidecars_encoder_reaches_the_store_and_the_viewer(receiver, store, store_path):
    reply = post(receiver, await sidecar_request("held-1"))
    assert reply.partial_success.rejected_spans == 0
    [call] = store.load("held-1").calls
    assert (call.held_ms, call.upstream, call.api) == (37.25, UPSTREAM, semconv.API_ANTHROPIC_MESSAGES)
    with start(store_path, index=False) as server:
        status, body = get(server, "/api/rollout?id=held-1")
    assert status == 200
    [shown] = body["calls"]
    assert (shown["held_ms"], shown["upstream"], shown["api"]) == (37.25, UPSTREAM, "anthropic.messages")


@pytest.mark.parametrize(
    ("attribute", "value", "reason"),
    [
        (semconv.CALL_HELD_MS, -1.0, "call.call_held_ms_negative"),
        (semconv.CALL_HELD_MS, math.inf, "call.call_held_ms_not_finite"),
        (semconv.CALL_HELD_MS, "12", "call.call_held_ms_not_number"),
        (semconv.CALL_UPSTREAM, "h" * 2049, "call.call_upstream_too_long"),
        (semconv.CALL_UPSTREAM, "http://replica\x1b[31m", "call.call_upstream_control_character"),
        (semconv.CALL_UPSTREAM, 8000, "call.call_upstream_not_string"),
        (semconv.CALL_API, "openai.chat\n", "call.call_api_control_character"),
        (semconv.CALL_API, "a" * 129, "call.call_api_too_long"),
    ],
)
def test_a_bad_value_refuses_that_span_alone_naming_the_attribute(receiver, store, attribute, value, reason):
    bad = with_attributes(call_span("r", 1, [1, 2, 3, 7, 4], [9]), **{attribute.replace(".", "__"): value})
    reply = post(receiver, request([call_span("r", 0, [1, 2, 3], [7]), bad, rollout_span("r")]).SerializeToString())
    assert reply.partial_success.rejected_spans == 1 and f"{reason}: 1" in reply.partial_success.error_message
    assert store.stats().violations == {reason: 1}
    assert [call.call_seq for call in store.load("r").calls] == [0]  # the span beside it is stored


def test_an_int_held_time_and_a_protocol_agl_does_not_name_are_kept(store):
    span = with_attributes(call_span("r", 0, [1], [2]), agl__call__held_ms=250, agl__call__api="acme.rpc")
    result = ingest(store, [span, rollout_span("r")])
    assert result.violations == {}
    [call] = store.load("r").calls
    assert (call.held_ms, call.upstream, call.api) == (250.0, None, "acme.rpc")


def test_a_schema_3_store_gains_the_columns_in_place_and_keeps_its_rows(store_path):
    with RolloutStore(store_path, grace_s=0.0) as store:
        ingest(store, [call_span("old", 0, [1, 2], [3]), rollout_span("old")])
    with sqlite3.connect(store_path) as db:  # back to schema 3: the calls table as it was
        for column in ("fields_dropped", "fields_passed", "agent_id", "parent_agent_id", "compaction", "held_ms",
                       "upstream", "api"):  # fmt: skip
            db.execute(f"ALTER TABLE calls DROP COLUMN {column}")
        db.execute("PRAGMA user_version=3")
    with RolloutStore(store_path, grace_s=0.0) as store:
        [old] = store.load("old").calls
        assert old.completion_ids.tolist() == [3] and (old.held_ms, old.upstream, old.api) == (None, None, None)
        held = with_attributes(call_span("new", 0, [1], [2]), agl__call__held_ms=5.5, agl__call__upstream=UPSTREAM)
        ingest(store, [held, rollout_span("new")])
        [new] = store.load("new").calls
        assert (new.held_ms, new.upstream) == (5.5, UPSTREAM)
        assert store.stats().calls == 2
    with sqlite3.connect(store_path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 6
        columns = [row[1] for row in db.execute("PRAGMA table_info(calls)")]
    assert columns[-8:] == [
        "held_ms", "upstream", "api", "agent_id", "parent_agent_id", "compaction", "fields_dropped", "fields_passed"
    ]


def test_a_second_process_upgrading_an_upgraded_store_goes_on_with_it(store_path):
    """Two processes open an old store at once: both read schema 3, the first upgrades it, the
    second's upgrade (which runs after the first's commit) finds the columns there and goes on."""
    with RolloutStore(store_path, grace_s=0.0) as store:
        ingest(store, [call_span("old", 0, [1, 2], [3]), rollout_span("old")])
        store._create_or_upgrade(3)  # what the second process does after reading version 3
        store._create_or_upgrade(0)  # and a second creator of a new store
        [old] = store.load("old").calls
        assert old.completion_ids.tolist() == [3]
    with sqlite3.connect(store_path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_inspect_shows_held_ms_when_a_call_was_held(store, store_path, capsys, monkeypatch):
    from agl_trainer.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    first = call_span("r", 0, [1, 2], [3])
    second = with_attributes(call_span("r", 1, [1, 2, 3, 4], [5]), agl__call__held_ms=12.5)
    ingest(store, [first, second, rollout_span("r")])
    assert main(["traces", "inspect", "r", "--store", str(store_path)]) == 0
    out = capsys.readouterr().out
    calls = out[out.index("calls") :]
    assert "held ms" in calls and "12.5" in calls
