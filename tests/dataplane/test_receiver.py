"""The receiver over real HTTP and gRPC on loopback: encodings, dedupe, auth, limits, bad input."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
import zlib

import grpc
import httpx
import pytest
from agl import semconv
from agl_trainer.receiver import Receiver, ReceiverConfig
from agl_trainer.store import RolloutStore
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from tests.dataplane.otlp import call_span, request, reward_span, rollout_span, span, to_otlp_json
from tests.support.waiting import wait_until

PROTOBUF = {"content-type": "application/x-protobuf"}


def post(receiver: Receiver, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{receiver.url}/v1/traces", content=body, headers=headers or PROTOBUF, timeout=30)


def rollout_spans(rollout_id: str = "r1"):
    return [
        call_span(rollout_id, 0, [1, 2, 3], [7, 8]),
        call_span(rollout_id, 1, [1, 2, 3, 7, 8, 4], [9]),
        reward_span(rollout_id, 0.5),
        rollout_span(rollout_id),
    ]


def test_protobuf_is_stored_once_even_when_sent_twice(receiver, store):
    body = request(rollout_spans()).SerializeToString()
    first = post(receiver, body)
    assert first.status_code == 200
    reply = ExportTraceServiceResponse.FromString(first.content)
    assert reply.partial_success.rejected_spans == 0
    assert post(receiver, body).status_code == 200
    stats = receiver.stats()
    assert (stats.stored, stats.duplicates, stats.spans) == (4, 4, 8)
    assert stats.tokens == 3 + 2 + 6 + 1
    data = store.load("r1")
    assert [call.call_seq for call in data.calls] == [0, 1]
    assert data.calls[1].prompt_ids.tolist() == [1, 2, 3, 7, 8, 4]
    assert [reward.value for reward in data.rewards] == [0.5]
    assert [r.rollout_id for r in store.ready_rollouts()] == ["r1"]


def test_json_and_gzip_and_deflate(receiver, store):
    as_json = json.dumps(to_otlp_json(request(rollout_spans("j")))).encode()
    reply = post(receiver, as_json, {"content-type": "application/json"})
    assert reply.status_code == 200 and reply.json() == {}
    gz = gzip.compress(request(rollout_spans("g")).SerializeToString())
    assert post(receiver, gz, {**PROTOBUF, "content-encoding": "gzip"}).status_code == 200
    deflated = zlib.compress(request(rollout_spans("d")).SerializeToString())
    assert post(receiver, deflated, {**PROTOBUF, "content-encoding": "deflate"}).status_code == 200
    for rollout_id in ("j", "g", "d"):
        assert store.load(rollout_id).calls[0].completion_ids.tolist() == [7, 8]


def test_grpc_export_with_compression(receiver, store):
    with grpc.insecure_channel(receiver.grpc_address) as channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        reply = stub.Export(request(rollout_spans("grpc")), timeout=30, compression=grpc.Compression.Gzip)
        assert reply.partial_success.rejected_spans == 0
        with pytest.raises(grpc.RpcError) as error:
            channel.unary_unary(  # raw bytes: the stub cannot send a malformed message
                "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                request_serializer=None,
                response_deserializer=None,
            )(b"\x0f\x00", timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unsupported wire type" in error.value.details()
    assert len(store.load("grpc").calls) == 2


def test_bearer_token_http_and_grpc(store_path):
    config = ReceiverConfig(port=0, grpc_port=0, token="s3cret")
    with Receiver(store_path, config) as receiver:
        body = request(rollout_spans()).SerializeToString()
        refused = post(receiver, body)
        assert refused.status_code == 401 and "bearer token" in refused.json()["message"]
        assert post(receiver, body, {**PROTOBUF, "authorization": "Bearer wrong"}).status_code == 401
        assert post(receiver, body, {**PROTOBUF, "authorization": "Bearer s3cret"}).status_code == 200
        with grpc.insecure_channel(receiver.grpc_address) as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as error:
                stub.Export(request(rollout_spans("x")), timeout=30)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stub.Export(
                request(rollout_spans("y")), timeout=30, metadata=[("authorization", "Bearer s3cret")]
            )
        assert receiver.stats().bad_requests == {"401_unauthorized": 2, "grpc_unauthorized": 1}
    with RolloutStore(store_path) as store:
        assert {r.rollout_id for r in store.rollouts()} == {"r1", "y"}


@pytest.mark.parametrize(
    "body, headers, status, message",
    [
        (b"\x0a\xff\xff\xff\x0f", PROTOBUF, 400, "runs past the end"),
        (b"{not json", {"content-type": "application/json"}, 400, "invalid OTLP JSON"),
        (b"\x1f\x8b garbage", {**PROTOBUF, "content-encoding": "gzip"}, 400, "not valid gzip"),
        (b"x", {**PROTOBUF, "content-encoding": "br"}, 400, "unsupported content-encoding"),
        (b"x", {"content-type": "text/plain"}, 415, "unsupported content-type"),
    ],
)
def test_bad_input_gets_a_clear_4xx(receiver, body, headers, status, message):
    reply = post(receiver, body, headers)
    assert reply.status_code == status
    assert reply.headers["content-type"].startswith("application/json")
    assert message in reply.json()["message"]
    assert receiver.stats().stored == 0


def test_size_limits(store_path):
    config = ReceiverConfig(port=0, max_request_bytes=4096, max_decompressed_bytes=8192)
    with Receiver(store_path, config) as receiver:
        big = request([call_span("r", 0, list(range(5000)), [1])]).SerializeToString()
        reply = post(receiver, big)
        assert reply.status_code == 413 and "limit of 4096" in reply.json()["message"]
        bomb = gzip.compress(b"\x00" * 100_000)  # small on the wire, large inflated
        assert len(bomb) < 4096
        reply = post(receiver, bomb, {**PROTOBUF, "content-encoding": "gzip"})
        assert reply.status_code == 413 and "decompressed" in reply.json()["message"]
        assert post(receiver, request(rollout_spans()).SerializeToString()).status_code == 200


def test_contract_violations_are_counted_kept_and_reported(receiver, store):
    bad = [
        call_span("", 0, [1], [2]),  # no rollout id
        call_span("r", 1, [1], [2, 3], logprobs=[-1.0]),  # logprobs do not match the completion
        span(
            "chat tiny",
            {
                semconv.GEN_AI_OPERATION_NAME: "chat",
                semconv.ROLLOUT_ID: "r",
                semconv.CALL_SEQ: 2,
                semconv.PROMPT_TOKEN_IDS: "1 2 3",
            },
        ),
        reward_span("r", float("nan")),
        span("http get", {"http.method": "GET"}),  # not agl's: ignored
        call_span("r", 0, [1, 2], [3]),  # fine
    ]
    reply = post(receiver, request(bad).SerializeToString())
    assert reply.status_code == 200
    partial = ExportTraceServiceResponse.FromString(reply.content).partial_success
    assert partial.rejected_spans == 4
    assert "call.missing_rollout_id: 1" in partial.error_message
    expected = {
        "call.missing_rollout_id": 1,
        "call.logprobs_length_mismatch": 1,
        "call.prompt_token_ids_not_int_array": 1,
        "reward.reward_value_not_finite": 1,
    }
    stats = receiver.stats()
    assert stats.violations == expected and stats.foreign == 1 and stats.stored == 5
    assert store.stats().violations == expected
    assert [call.call_seq for call in store.load("r").calls] == [0]
    metrics = httpx.get(f"{receiver.url}/metrics").text
    assert 'agl_receiver_contract_violations_total{reason="call.missing_rollout_id"} 1' in metrics
    assert httpx.get(f"{receiver.url}/stats").json()["violations"] == expected
    assert httpx.get(f"{receiver.url}/healthz").json() == {"status": "ok"}


def test_real_sdk_spans_reach_the_store(receiver, store, tmp_path):
    """agl.rollout and agl.emit_reward, exported by the SDK's own OTLP pipeline (a separate process,
    so its global tracer state stays out of this one)."""
    script = textwrap.dedent(
        f"""
        import agl
        agl.init(endpoint={receiver.url!r}, service_name="harness")
        with agl.rollout(rollout_id="sdk-1", task_id="t9", mode="train"):
            agl.emit_reward({{"reward": 0.25, "format": 1.0}})
            agl.emit_reward(0.75)
            agl.emit_reward(2.0, call_seq=0)
        assert agl.flush(10.0)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    [ready] = store.ready_rollouts()
    assert (ready.rollout_id, ready.task_id, ready.status, ready.end_cause) == (
        "sdk-1",
        "t9",
        "succeeded",
        "ok",
    )
    data = store.load("sdk-1")
    by_name = [(r.name, r.value, r.call_seq) for r in data.rewards]
    assert sorted(by_name, key=repr) == sorted(
        [("reward", 0.25, None), ("format", 1.0, None), ("reward", 0.75, None), ("reward", 2.0, 0)], key=repr
    )
    assert [r.value for r in data.rewards if r.name == "reward" and r.call_seq is None][-1] == 0.75


def test_a_store_that_cannot_commit_gets_503_and_the_retry_is_stored(store_path):
    import sqlite3

    RolloutStore(store_path).close()  # create the schema
    store = RolloutStore(store_path, busy_timeout_s=0.2)
    with Receiver(store, ReceiverConfig(port=0)) as receiver:
        blocker = sqlite3.connect(store_path, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")  # another writer holds the lock: commits fail
        body = request(rollout_spans()).SerializeToString()
        reply = post(receiver, body)
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert "could not commit" in reply.json()["message"]
        blocker.execute("ROLLBACK")
        blocker.close()
        assert post(receiver, body).status_code == 200  # the exporter's retry
        assert receiver.stats().bad_requests == {"503_store_error": 1}
    with RolloutStore(store_path) as reopened:
        assert len(reopened.span_ids()) == 4
    store.close()


def test_a_sender_that_goes_away_mid_body_is_counted_not_a_traceback(receiver, store, caplog):
    import socket
    import time

    host, port = receiver.url.removeprefix("http://").rsplit(":", 1)
    body = request(rollout_spans()).SerializeToString()
    with socket.create_connection((host, int(port))) as sender:
        sender.sendall(
            b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[: len(body) // 2]
        )
        time.sleep(0.2)  # the receiver is now waiting for the rest
    wait_until(lambda: receiver.stats().bad_requests.get("sender_disconnected") == 1, "the disconnect", 10)
    assert receiver.stats().bad_requests == {"sender_disconnected": 1}
    assert not [r for r in caplog.records if r.exc_info], "a disconnect is logged as a traceback"
    assert receiver.stats().stored == 0  # half a batch is not stored
    assert post(receiver, body).status_code == 200  # the resend is
    assert [call.call_seq for call in store.load("r1").calls] == [0, 1]
