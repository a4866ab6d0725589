"""The receiver against hostile and broken input, over real HTTP and gRPC on loopback.

Every case here answered 500 or 503 once, or acknowledged spans and dropped them (issue 14). Data
errors are 400 for a request that cannot be split into spans, else a violation of the bad span
alone (OTLP partialSuccess), with every other span of the request stored; 5xx is only for the
receiver's own faults, and then nothing of the request is written.

JSON nested deeper than the parser goes (a few hundred levels) or a string it refuses costs only
its span too (tests/dataplane/test_json_one_record.py); values nested past the receiver's own bound
(32) are per-span, as in protobuf at any depth.
"""

from __future__ import annotations

import gzip
import json
import threading

import grpc
import httpx
import pytest
from agl import semconv
from agl_trainer.receiver import Receiver, ReceiverConfig
from agl_trainer.store import RolloutStore
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from tests.dataplane.hostile import (
    export_request,
    field,
    int_value,
    nested_array,
    nested_json_array,
    nested_json_kvlist,
    nested_kvlist,
    with_attribute,
)
from tests.dataplane.otlp import call_span, request, reward_span, to_otlp_json

PROTOBUF = {"content-type": "application/x-protobuf"}
JSON = {"content-type": "application/json"}
INT64_MAX = 2**63 - 1


def post(receiver: Receiver, body: bytes, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{receiver.url}/v1/traces", content=body, headers=headers or PROTOBUF, timeout=30)


def rejected(reply: httpx.Response) -> tuple[int, str]:
    if reply.headers["content-type"].startswith("application/json"):
        partial = reply.json().get("partialSuccess", {})
        return int(partial.get("rejectedSpans", 0)), partial.get("errorMessage", "")
    partial = ExportTraceServiceResponse.FromString(reply.content).partial_success
    return partial.rejected_spans, partial.error_message


# --- protobuf: one bad span among good ones -------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, reason",
    [
        # the sidecar once wrote an attempt of 10^22 as an 11-byte varint: the receiver answered 503
        (semconv.CALL_SEQ, int_value(10**22), "call.call_seq_malformed"),
        (semconv.CALL_SEQ, int_value(2**64 + 5), "call.call_seq_int_out_of_range"),  # 10 bytes, over 64 bits
        (semconv.ATTEMPT, int_value(2**64 - 1), "call.attempt_negative"),  # int64 -1
        (semconv.POLICY_VERSION, int_value(10**22), "call.policy_version_malformed"),
        (semconv.PROMPT_TOKEN_IDS, nested_array(1, int_value(2**40)), "call.prompt_token_ids_out_of_range"),
        (semconv.PROMPT_TOKEN_IDS, nested_array(3000), "call.prompt_token_ids_nesting_too_deep"),
        (semconv.ROLLOUT_ID, nested_kvlist(3000), "call.rollout_id_nesting_too_deep"),
        (semconv.ROLLOUT_ID, b"\x0a\x02\xff\xfe", "call.rollout_id_invalid_utf8"),
        # ids are bounded (docs/spans.md): a 1 MB rollout id was stored in every row of its rollout
        (semconv.ROLLOUT_ID, field(1, b"r" * 1_000_000), "call.rollout_id_too_long"),
        (semconv.ROLLOUT_ID, field(1, b"r" * (semconv.ROLLOUT_ID_MAX_CHARS + 1)), "call.rollout_id_too_long"),
        (semconv.TASK_ID, field(1, b"t" * (semconv.ROLLOUT_ID_MAX_CHARS + 1)), "call.task_id_too_long"),
    ],
)
def test_a_bad_value_costs_its_span_only_protobuf(receiver, store, key, value, reason):
    good = [call_span("good", 0, [1, 2], [3]), reward_span("good", 1.0)]
    bad = with_attribute(call_span("bad", 0, [1, 2], [3]), key, value)
    body = export_request(good[0].SerializeToString(), bad, good[1].SerializeToString())
    reply = post(receiver, body)
    assert reply.status_code == 200, reply.text
    count, message = rejected(reply)
    assert count == 1 and reason in message
    assert receiver.stats().violations == {reason: 1}
    assert [call.call_seq for call in store.load("good").calls] == [0]
    assert store.rollout("bad") is None


def test_a_deep_value_in_an_attribute_agl_does_not_read_is_harmless(receiver, store):
    """A harness attribute nested 3,000 deep (JSON and protobuf): the span itself is fine."""
    body = export_request(with_attribute(call_span("r", 0, [1], [2]), "harness.blob", nested_array(3000)))
    assert post(receiver, body).status_code == 200
    payload = to_otlp_json(request([call_span("j", 0, [1], [2])]))
    attributes = payload["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"]
    attributes.append({"key": "harness.blob", "value": "@DEEP@"})
    text = json.dumps(payload).replace('"@DEEP@"', nested_json_kvlist(100))
    assert post(receiver, text.encode(), JSON).status_code == 200
    assert receiver.stats().violations == {}
    assert len(store.load("r").calls) == 1 and len(store.load("j").calls) == 1


def test_times_above_int64_are_clamped_not_refused(receiver, store):
    """2^64 - 1 is a legal fixed64; SQLite's INTEGER is int64 (once a 503 for the whole group)."""
    late = call_span("late", 0, [1], [2], start_ns=2**64 - 2, end_ns=2**64 - 1)
    reply = post(receiver, request([late, reward_span("late", 0.5)]).SerializeToString())
    assert reply.status_code == 200 and rejected(reply)[0] == 0
    [call] = store.load("late").calls
    assert call.end_ns == INT64_MAX


def test_ids_at_the_bound_are_stored_and_a_long_reward_id_costs_its_span(receiver, store):
    longest = "r" * semconv.ROLLOUT_ID_MAX_CHARS
    too_long = with_attribute(reward_span("x", 1.0), semconv.ROLLOUT_ID, field(1, b"r" * 10_000))
    body = export_request(call_span(longest, 0, [1], [2]).SerializeToString(), too_long)
    reply = post(receiver, body)
    assert reply.status_code == 200 and rejected(reply)[0] == 1
    assert receiver.stats().violations == {"reward.rollout_id_too_long": 1}
    assert len(store.load(longest).calls) == 1


def test_a_span_with_broken_bytes_costs_only_itself(receiver, store):
    """Framing broken inside one span (a truncated varint in its name's length): that span is a
    violation; the spans around it, in the same request, are stored."""
    broken = b"\x0a\x10" + bytes(16) + b"\x12\x08" + bytes(range(1, 9)) + b"\x2a\x85"  # name: length cut
    good = call_span("fine", 0, [1], [2]).SerializeToString()
    reply = post(receiver, export_request(good, broken))
    assert reply.status_code == 200
    assert rejected(reply)[0] == 1 and receiver.stats().violations == {"span.undecodable": 1}
    assert len(store.load("fine").calls) == 1


# --- JSON -------------------------------------------------------------------------------------------


def json_call(rollout_id: str, **overrides: object) -> dict:
    payload = to_otlp_json(request([call_span(rollout_id, 0, [1, 2], [3])]))
    item = payload["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    for key, value in overrides.items():
        if key.startswith("agl."):
            item["attributes"] = [kv for kv in item["attributes"] if kv["key"] != key]
            item["attributes"].append({"key": key, "value": value})
        else:
            item[key] = value
    return item


def json_body(*spans: dict) -> bytes:
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": list(spans)}]}]}).encode()


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (
            {semconv.PROMPT_TOKEN_IDS: {"arrayValue": {"values": [{"intValue": 99999999999999999999}]}}},
            "call.prompt_token_ids_int_out_of_range",
        ),
        (
            {semconv.COMPLETION_TOKEN_IDS: {"arrayValue": {"values": [{"intValue": "-1"}]}}},
            "call.completion_token_ids_out_of_range",
        ),
        ({semconv.CALL_SEQ: {"intValue": str(2**63)}}, "call.call_seq_int_out_of_range"),
        ({semconv.CALL_SEQ: {"intValue": "seven"}}, "call.call_seq_not_int"),
        ({semconv.CALL_SEQ: {"intValue": "@HUGE@"}}, "call.call_seq_malformed"),  # 1e400: no int64
        ({semconv.ROLLOUT_ID: {"bytesValue": "not base64!"}}, "call.rollout_id_bad_base64"),
        ({semconv.PROMPT_TOKEN_IDS: "@DEEP_ARRAY@"}, "call.prompt_token_ids_nesting_too_deep"),
        ({semconv.ROLLOUT_ID: "@DEEP_KVLIST@"}, "call.rollout_id_nesting_too_deep"),
        ({semconv.TASK_ID: {"arrayValue": {"values": [{"doubleValue": "x"}]}}}, "call.task_id_not_number"),
        ({"startTimeUnixNano": str(2**64)}, "call.bad_time"),
        ({"endTimeUnixNano": "yesterday"}, "call.bad_time"),
        ({"status": {"code": 2**40}}, "call.status_code_out_of_range"),
        ({"spanId": "xyz"}, "call.bad_ids"),
    ],
)
def test_a_bad_value_costs_its_span_only_json(receiver, store, overrides, reason):
    text = json_body(json_call("good-1"), json_call("bad", **overrides), json_call("good-2")).decode()
    text = text.replace('"@DEEP_ARRAY@"', nested_json_array(100))
    text = text.replace('"@DEEP_KVLIST@"', nested_json_kvlist(100)).replace('"@HUGE@"', "1e400")
    reply = post(receiver, text.encode(), JSON)
    assert reply.status_code == 200, reply.text
    count, message = rejected(reply)
    assert count == 1 and reason in message, message
    assert len(store.load("good-1").calls) == 1 and len(store.load("good-2").calls) == 1
    assert store.rollout("bad") is None


def test_json_spelled_differently_is_the_same_span(receiver, store):
    """OTLP JSON as other exporters write it: ints as numbers, enum names, base64 ids, unknown
    fields, fields in another order: stored exactly as the canonical spelling is."""
    item = json_call("spelled", **{semconv.CALL_SEQ: {"intValue": 0}})
    item["kind"] = "SPAN_KIND_CLIENT"
    item["status"] = {"code": "STATUS_CODE_OK", "futureField": [1, {"x": None}]}
    item["traceId"] = "AAECAwQFBgcICQoLDA0ODw=="  # base64, as a generic proto3 JSON mapping writes it
    item["droppedAttributesCount"] = 3
    item = dict(reversed(list(item.items())))
    reply = post(receiver, json_body(item), JSON)
    assert reply.status_code == 200 and rejected(reply)[0] == 0
    assert (bytes(range(16)), bytes.fromhex(item["spanId"])) in store.span_ids()
    assert store.load("spelled").calls[0].prompt_ids.tolist() == [1, 2]


# --- whole requests ---------------------------------------------------------------------------------


def test_two_gzip_members_are_both_stored(receiver, store):
    """gzip allows a body of several members; acknowledging it and storing only the first lost spans."""
    first = gzip.compress(request([call_span("m1", 0, [1], [2])]).SerializeToString())
    second = gzip.compress(request([call_span("m2", 0, [1], [2])]).SerializeToString())
    reply = post(receiver, first + second, {**PROTOBUF, "content-encoding": "gzip"})
    assert reply.status_code == 200
    assert len(store.load("m1").calls) == 1 and len(store.load("m2").calls) == 1


@pytest.mark.parametrize(
    "body, headers, status, message",
    [
        (gzip.compress(b"\x0a\x00")[:-4], {**PROTOBUF, "content-encoding": "gzip"}, 400, "truncated"),
        (gzip.compress(b"\x0a\x00") + b"tail", {**PROTOBUF, "content-encoding": "gzip"}, 400, "after the last"),
        (b"", JSON, 400, "invalid OTLP JSON"),
        (b"[" * 100_000, JSON, 400, "invalid OTLP JSON"),

        (b"\x0a\x05\x12\x03\x12\x01", PROTOBUF, 400, "runs past the end"),
        (b"x", {"content-type": "text/html"}, 415, "unsupported content-type"),
    ],
)
def test_undecodable_requests_are_400_with_a_reason(receiver, body, headers, status, message):
    reply = post(receiver, body, headers)
    assert reply.status_code == status
    assert message in reply.json()["message"]


def test_an_empty_protobuf_body_is_an_empty_request(receiver):
    reply = post(receiver, b"")
    assert reply.status_code == 200 and rejected(reply)[0] == 0


def test_a_non_utf8_authorization_header_is_401(store_path):
    config = ReceiverConfig(port=0, token="s3cret")
    with Receiver(store_path, config) as receiver:
        body = request([call_span("r", 0, [1], [2])]).SerializeToString()
        for value in (b"Bearer \xff\xfe", "Bearer sécret".encode(), b"\xc3"):
            reply = post(receiver, body, {**PROTOBUF, "authorization": value})
            assert reply.status_code == 401, value
        assert post(receiver, body, {**PROTOBUF, "authorization": "Bearer s3cret"}).status_code == 200


def test_garbage_on_the_grpc_and_http_paths_is_refused_cleanly(receiver):
    method = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
    with grpc.insecure_channel(receiver.grpc_address) as channel:
        export = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        for body in (b"\xff" * 64, export_request(b"\x0a\x02\xff"), b"\x0a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80"):
            try:
                export(body, timeout=30)
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        # a deep value over gRPC is a violation, not an error
        reply = export(export_request(with_attribute(call_span("g", 0, [1], [2]), semconv.ROLLOUT_ID,
                                                     nested_array(3000))), timeout=30)
        assert ExportTraceServiceResponse.FromString(reply).partial_success.rejected_spans == 1
    reply = httpx.post(f"{receiver.url}{method}", content=b"\x00garbage", headers={"content-type": "application/grpc"})
    assert reply.status_code in (404, 405)


# --- the receiver's own faults ----------------------------------------------------------------------


def test_disk_full_is_503_with_retry_after_and_nothing_half_written(store_path):
    """SQLITE_FULL (here from max_page_count, the error a full disk gives): 503 + Retry-After for
    every request of the group, none of their spans written; the sender's retry is stored."""
    RolloutStore(store_path).close()
    store = RolloutStore(store_path)
    with Receiver(store, ReceiverConfig(port=0)) as receiver:
        pages = store._db.execute("PRAGMA page_count").fetchone()[0]
        store._db.execute(f"PRAGMA max_page_count = {pages}")  # not one page more
        bodies = [
            request([call_span(f"full-{i}", 0, list(range(4000)), [1]), reward_span(f"full-{i}", 1.0)])
            .SerializeToString()
            for i in range(6)
        ]
        replies: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda b=body: replies.append(post(receiver, b))) for body in bodies]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [reply.status_code for reply in replies] == [503] * 6
        assert all(reply.headers["retry-after"] == "1" for reply in replies)
        assert "full" in replies[0].json()["message"]
        assert store.span_ids() == set()  # nothing half-written
        store._db.execute("PRAGMA max_page_count = 1073741823")  # space again
        assert all(post(receiver, body).status_code == 200 for body in bodies)
        assert receiver.stats().bad_requests == {"503_store_error": 6}
    assert len(store.span_ids()) == 12
    store.close()


def test_a_value_the_store_refuses_costs_no_other_request(store_path):
    """The store's last line: a record that slipped past the contract with a value SQLite refuses
    (an int over int64) fails neither the group commit nor the other records of its request."""
    from agl_trainer.receiver.contract import classify
    from agl_trainer.receiver.wire import decode_protobuf

    def records(rollout_id: str) -> list:
        return [classify(raw) for raw in decode_protobuf(request([call_span(rollout_id, 0, [1], [2])]).SerializeToString())]

    poisoned = records("poison") + records("neighbour")
    poisoned[0].call_seq = 2**70  # what the contract would have refused
    with RolloutStore(store_path, grace_s=0.0) as store:
        results = store.write_batches([records("before"), poisoned, records("after")])
        assert [result.stored for result in results] == [1, 2, 1]
        assert results[1].violations == {"store_rejected": 1}
        assert {info.rollout_id for info in store.rollouts()} == {"before", "neighbour", "after"}
