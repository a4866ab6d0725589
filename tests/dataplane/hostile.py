"""OTLP bodies no ordinary exporter writes, built byte by byte: over-long varints, deep nesting.

The protobuf library cannot write these (it refuses the values or recurses past Python's limit),
so they are assembled from the wire format directly, around spans the library did build.
"""

from __future__ import annotations

from opentelemetry.proto.trace.v1.trace_pb2 import Span


def varint(value: int) -> bytes:
    """A base-128 varint of any size (an encoder that does not range-check writes 10^22 so)."""
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def int_value(value: int) -> bytes:
    """AnyValue{int_value} with `value` written as an unbounded varint."""
    return varint(3 << 3) + varint(value)


def nested_array(depth: int, innermost: bytes | None = None) -> bytes:
    """AnyValue: `depth` arrayValues, each holding the next; the innermost holds int 1."""
    value = innermost if innermost is not None else int_value(1)
    for _ in range(depth):
        value = field(5, field(1, value))  # AnyValue.array_value = ArrayValue{values = [value]}
    return value


def nested_kvlist(depth: int) -> bytes:
    """AnyValue: `depth` kvlistValues, each holding the next under key "k"."""
    value = int_value(1)
    for _ in range(depth):
        value = field(6, field(1, field(1, b"k") + field(2, value)))
    return value


def with_attribute(span: Span, key: str, any_value: bytes) -> bytes:
    """The span's bytes with one more attribute appended (protobuf merges repeated fields)."""
    return span.SerializeToString() + field(9, field(1, key.encode()) + field(2, any_value))


def export_request(*spans: bytes) -> bytes:
    """ExportTraceServiceRequest{resource_spans: [{scope_spans: [{spans}]}]} from serialized spans."""
    scope_spans = b"".join(field(2, span) for span in spans)
    return field(1, field(2, scope_spans))


def nested_json_array(depth: int) -> str:
    return '{"arrayValue":{"values":[' * depth + '{"intValue":"1"}' + "]}}" * depth


def nested_json_kvlist(depth: int) -> str:
    return '{"kvlistValue":{"values":[{"key":"k","value":' * depth + '{"intValue":"1"}' + "}]}}" * depth
