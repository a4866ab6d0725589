"""The hand-written OTLP encoder against the official protobuf decoder."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import ArrayValue

from agl_sidecar.spans import otlp
from tests.support.otlp_sink import any_value


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=300))
def test_int_arrays_decode_to_the_same_values(values):
    array = ArrayValue()
    array.ParseFromString(otlp.IntArray.of(values).elements)
    assert [v.int_value for v in array.values] == values


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(allow_nan=False), max_size=100))
def test_double_arrays_decode_to_the_same_values(values):
    array = ArrayValue()
    array.ParseFromString(otlp.DoubleArray(values).elements)
    assert [v.double_value for v in array.values] == values


def test_span_request_round_trip():
    framer = otlp.RequestFramer({"service.name": "agl-sidecar"}, "agl", "0.1.0")
    span = otlp.span(
        trace_id=bytes(range(16)), span_id=bytes(range(8)), parent_span_id=b"\x01" * 8, name="chat tiny",
        kind=otlp.SPAN_KIND_CLIENT, start_ns=1, end_ns=2,
        attrs=[("s", "x"), ("b", False), ("i", -3), ("d", 0.5), ("ids", otlp.IntArray.of([5, 70000])),
               ("names", ["stop", "length"]), ("skipped", None)],
        status_code=otlp.STATUS_ERROR, status_message="boom",
    )
    request = ExportTraceServiceRequest()
    request.ParseFromString(framer.request([span, span]))
    (resource_spans,) = request.resource_spans
    assert resource_spans.resource.attributes[0].value.string_value == "agl-sidecar"
    decoded = resource_spans.scope_spans[0].spans
    assert len(decoded) == 2 and decoded[0].name == "chat tiny" and decoded[0].kind == otlp.SPAN_KIND_CLIENT
    assert decoded[0].parent_span_id == b"\x01" * 8 and decoded[0].status.message == "boom"
    attrs = {kv.key: any_value(kv.value) for kv in decoded[0].attributes}
    assert attrs == {"s": "x", "b": False, "i": -3, "d": 0.5, "ids": [5, 70000], "names": ["stop", "length"]}
    assert framer.overhead(span) + len(framer.request([span])) == len(framer.request([span, span]))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2**21 - 1), min_size=1, max_size=1200))
def test_equal_sequences_have_equal_bytes_whatever_their_length(values):
    # Prompt references compare encoded bytes: a short prefix must encode as the start of a long array.
    whole = otlp.IntArray.of(values + values)
    assert whole.elements.startswith(otlp.IntArray.of(values).elements)
    assert (otlp.IntArray.of(values) + otlp.IntArray.of(values)).elements == whole.elements


@settings(max_examples=300, deadline=None)
@given(value=st.one_of(st.integers(), st.integers(min_value=-(2**70), max_value=2**70)))
def test_any_int_attribute_is_sent_exactly_or_named_as_out_of_range(value):
    """protobuf decoders accept an over-long varint and store it wrapped: an int outside int64 must
    never be written, whatever its size; the span says which key it dropped instead."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    encoded = otlp.span(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, parent_span_id=None, name="x", kind=1,
                        start_ns=1, end_ns=2, attrs=[("agl.attempt", value), ("agl.call.seq", 7)])
    span = Span()
    span.ParseFromString(encoded)
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert attrs["agl.call.seq"].int_value == 7
    if -(2**63) <= value < 2**63:
        assert attrs["agl.attempt"].int_value == value and otlp.OUT_OF_RANGE_KEY not in attrs
    else:
        assert "agl.attempt" not in attrs
        assert [v.string_value for v in attrs[otlp.OUT_OF_RANGE_KEY].array_value.values] == [f"agl.attempt={value}"]


@given(values=st.lists(st.integers(min_value=-(2**64), max_value=2**64), max_size=40))
def test_token_arrays_beyond_int64_are_refused_not_wrapped(values):
    if all(-(2**63) <= v < 2**63 for v in values):
        assert otlp.IntArray.of(values).length == len(values)
    else:
        with pytest.raises(otlp.OutOfRange):
            otlp.IntArray.of(values)
