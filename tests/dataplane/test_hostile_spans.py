"""The receiver against senders that spell OTLP/HTTP otherwise or break HTTP itself."""

from __future__ import annotations

import gzip
import json
import logging
import socket
from urllib.parse import urlsplit

import httpx
import pytest
from agl import semconv

from tests.dataplane.otlp import call_span, request
from tests.dataplane.test_hostile_input import json_call


def _raw(url: str, data: bytes) -> bytes:
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as conn:
        conn.sendall(data)
        out = b""
        while chunk := conn.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # request line over aiohttp's 8190
        b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\nContent-Length: 0\r\n\r\n",
        b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    ],
)
def test_malformed_http_is_a_400_and_a_warning_not_a_traceback(receiver, caplog, request_bytes):
    # Before: aiohttp logged each as an ERROR with a traceback, the sender's fault in the trainer's log.
    with caplog.at_level(logging.WARNING, logger="aiohttp.server"):
        answer = _raw(receiver.url, request_bytes)
    assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n", 1)[0]
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert records and all(r.levelno == logging.WARNING and r.exc_info is None for r in records)
    assert "refused, 400" in records[0].getMessage()


def test_x_gzip_is_gzip(receiver, store):
    body = request([call_span("r-xgzip", 0, [1, 2], [3])]).SerializeToString()
    answer = httpx.post(
        receiver.url.rstrip("/") + "/v1/traces",
        content=gzip.compress(body),
        headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "x-gzip"},
    )
    assert answer.status_code == 200, answer.text
    assert [call.completion_ids.tolist() for call in store.load("r-xgzip").calls] == [[3]]


# --- OTLP JSON spelled as proto3's JSON mapping allows --------------------------------------------

JSON = {"content-type": "application/json"}


def _post_json(receiver, *spans: object) -> httpx.Response:
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": list(spans)}]}]}).encode()
    return httpx.post(f"{receiver.url}/v1/traces", content=body, headers=JSON, timeout=30)


def _rejected(reply: httpx.Response) -> tuple[int, str]:
    partial = reply.json().get("partialSuccess", {})
    return int(partial.get("rejectedSpans", 0)), partial.get("errorMessage", "")


@pytest.mark.parametrize(
    "overrides",
    [
        {"startTimeUnixNano": 1.7e18, "endTimeUnixNano": 1.7e18},  # a number with an exponent
        {"kind": 3.0, "status": {"code": None, "message": None}},
        {"parentSpanId": None, "name": None},  # proto3 JSON: null is the field's default
        {semconv.CALL_SEQ: {"intValue": 0.0}},  # an integral double for an int64, as protobuf takes
        {semconv.PROMPT_TOKEN_IDS: {"arrayValue": {"values": [{"intValue": 1.0}, {"intValue": "2"}]}}},
    ],
)
def test_json_spelled_as_proto3_allows_is_the_same_span(receiver, store, overrides):
    # Before: each of these refused the whole request (400), every span in it lost.
    reply = _post_json(receiver, json_call("other"), json_call("spelled", **overrides))
    assert reply.status_code == 200, reply.text
    assert _rejected(reply)[0] == 0
    (call,) = store.load("spelled").calls
    assert call.prompt_ids.tolist() == [1, 2] and call.completion_ids.tolist() == [3]
    assert len(store.load("other").calls) == 1


@pytest.mark.parametrize(
    "bad",
    [
        "not a span",
        {"traceId": "0af7651916cd43dd8448eb211c80319c", "spanId": "b7ad6b7169203331", "attributes": {"a": 1}},
        {"traceId": "0af7651916cd43dd8448eb211c80319c", "spanId": "b7ad6b7169203331", "name": ["x"]},
    ],
)
def test_a_span_of_the_wrong_shape_costs_only_itself(receiver, store, bad):
    # Before: the request's typed decode failed and all three spans were refused with a 400.
    reply = _post_json(receiver, json_call("good-1"), bad, json_call("good-2"))
    assert reply.status_code == 200, reply.text
    count, message = _rejected(reply)
    assert count == 1 and "undecodable" in message
    assert len(store.load("good-1").calls) == 1 and len(store.load("good-2").calls) == 1


def test_a_float_that_is_not_an_integer_is_still_refused_as_an_int(receiver, store):
    reply = _post_json(receiver, json_call("good"), json_call("half", **{semconv.CALL_SEQ: {"intValue": 0.5}}))
    count, message = _rejected(reply)
    assert count == 1 and "call_seq_not_int" in message
    assert store.rollout("half") is None and len(store.load("good").calls) == 1


def test_nan_logprobs_keep_the_call_and_drop_only_the_logprobs(receiver, store):
    # A NaN behaviour logprob would make its token's importance weight NaN (torch's clamp keeps NaN)
    # and poison the step's loss: the call is stored, its logprobs left out (assembly: logprobs_missing).
    spans = [call_span("nan-lp", 0, [1, 2], [3, 4], [-0.5, float("nan")]), call_span("inf-lp", 0, [1], [3], [float("-inf")])]
    reply = httpx.post(
        f"{receiver.url}/v1/traces", content=request(spans).SerializeToString(),
        headers={"Content-Type": "application/x-protobuf"},
    )  # fmt: skip
    assert reply.status_code == 200
    (call,) = store.load("nan-lp").calls
    assert call.completion_ids.tolist() == [3, 4] and call.logprobs is None
    (kept,) = store.load("inf-lp").calls
    assert kept.logprobs.tolist() == [float("-inf")]
