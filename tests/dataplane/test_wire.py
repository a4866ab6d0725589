"""The receiver's protobuf walker and JSON decoder against opentelemetry-proto's own decoding."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from agl_trainer.receiver.arrays import decode_double_array, decode_int_array
from agl_trainer.receiver.contract import Violation, classify
from agl_trainer.receiver.wire import DecodeError, decode_json, decode_protobuf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.dataplane.otlp import any_value, request, span, to_otlp_json
from tests.support.otlp_sink import any_value as reference_value

scalars = st.one_of(
    st.text(max_size=20),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
)
values = st.one_of(
    scalars,
    st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=40),
    st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=20),
    st.lists(scalars, max_size=5),
)
attribute_maps = st.dictionaries(st.text(min_size=1, max_size=12), values, max_size=8)


def _plain(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _reference(message: ExportTraceServiceRequest) -> list[dict]:
    out = []
    for resource_spans in message.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for item in scope_spans.spans:
                out.append(
                    {
                        "trace_id": item.trace_id,
                        "span_id": item.span_id,
                        "parent": item.parent_span_id,
                        "name": item.name,
                        "kind": item.kind,
                        "start": item.start_time_unix_nano,
                        "end": item.end_time_unix_nano,
                        "code": item.status.code,
                        "message": item.status.message,
                        "attributes": {kv.key: reference_value(kv.value) for kv in item.attributes},
                    }
                )
    return out


def _ours(spans) -> list[dict]:
    return [
        {
            "trace_id": s.trace_id,
            "span_id": s.span_id,
            "parent": s.parent_span_id,
            "name": s.name,
            "kind": s.kind,
            "start": s.start_ns,
            "end": s.end_ns,
            "code": s.status_code,
            "message": s.status_message,
            "attributes": _plain(s.attributes),
        }
        for s in spans
    ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(attribute_maps, min_size=1, max_size=4), st.text(max_size=10))
def test_walker_decodes_what_opentelemetry_proto_decodes(attribute_sets, status_message):
    spans = [span("s", attributes, status_code=2) for attributes in attribute_sets]
    for item in spans:
        item.status.message = status_message
        item.parent_span_id = b"\x01" * 8
    message = request(spans)
    expected = _reference(message)
    for item in expected:  # opentelemetry-proto gives empty arrays as []; so do we
        item["attributes"] = {k: v for k, v in item["attributes"].items()}
    assert _ours(decode_protobuf(message.SerializeToString())) == expected


@settings(max_examples=40, deadline=None)
@given(attribute_maps)
def test_json_decodes_like_protobuf(attributes):
    message = request([span("s", attributes)])
    body = json.dumps(to_otlp_json(message)).encode()
    from_json = _ours(decode_json(body))
    from_proto = _ours(decode_protobuf(message.SerializeToString()))
    # JSON carries doubles that happen to be whole numbers the same way; compare with tolerance for floats
    assert json.dumps(from_json, default=repr, sort_keys=True) == json.dumps(
        from_proto, default=repr, sort_keys=True
    )


def test_int_array_fast_path_matches_and_falls_back():
    ids = [0, 1, 127, 128, 16383, 16384, 151_643, 2**31 - 1, 2**40]
    encoded = any_value(ids).array_value.SerializeToString()
    assert decode_int_array(encoded, 0, len(encoded)).tolist() == ids
    negative = any_value([5, -1, 7]).array_value.SerializeToString()
    assert decode_int_array(negative, 0, len(negative)) is None  # 10-byte varint: generic path
    mixed = any_value([1, "x"]).array_value.SerializeToString()
    assert decode_int_array(mixed, 0, len(mixed)) is None
    doubles = [-0.5, 1e-300, -math.pi, 0.0]
    encoded = any_value(doubles).array_value.SerializeToString()
    assert decode_double_array(encoded, 0, len(encoded)).tolist() == doubles
    [decoded] = decode_protobuf(request([span("s", {"a": [5, -1, 7]})]).SerializeToString())
    assert decoded.attributes["a"].tolist() == [5, -1, 7]


@pytest.mark.parametrize(
    "body, message",
    [
        (b"\x0a\xff\xff\xff\xff\x0f", "runs past the end"),
        (b"\x0a", "truncated varint"),
        (b"\x0f\x00", "unsupported wire type"),
    ],
)
def test_malformed_protobuf_names_the_problem(body, message):
    with pytest.raises(DecodeError, match=message):
        decode_protobuf(body)


def test_truncated_request_is_an_error():
    body = request([span("s", {"agl.prompt.token_ids": list(range(300))})]).SerializeToString()
    with pytest.raises(DecodeError):
        decode_protobuf(body[: len(body) // 2])


def test_malformed_json_names_the_problem():
    with pytest.raises(DecodeError, match="invalid OTLP JSON"):
        decode_json(b'{"resourceSpans": 3}')
    # A span's bad id is that span's problem, not the request's: the contract refuses it alone.
    [raw] = decode_json(
        b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz", "spanId": "0102030405060708",'
        b' "name": "agl.reward", "attributes": [{"key": "agl.rollout.id", "value": {"stringValue": "r"}}]}]}]}]}'
    )
    assert raw.trace_id == b""
    violation = classify(raw)
    assert isinstance(violation, Violation) and violation.reason == "reward.bad_ids"
