"""What the OTLP decoders produce (`RawSpan`, with undecodable values as `BadValue`) and the one error
that refuses a whole request (`DecodeError`). Shared by otlp_protobuf.py and otlp_json.py."""

from __future__ import annotations

from typing import Any

import msgspec


MAX_VALUE_DEPTH = 32  # nested arrayValue / kvlistValue levels; agl's own values use 1
UINT64_MAX = (1 << 64) - 1


class DecodeError(ValueError):
    """The payload is not a valid OTLP ExportTraceServiceRequest; the message says where."""


class BadValue(msgspec.Struct, frozen=True, gc=False):
    """An attribute value that could not be decoded; `reason` is a stable token (int_out_of_range,
    nesting_too_deep, bad_base64, not_int, not_number, invalid_utf8, malformed), `detail` says more."""

    reason: str
    detail: str = ""


class RawSpan(msgspec.Struct, gc=False):
    """One span as it came over the wire. Int arrays are numpy int64, double arrays float64."""

    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes
    name: str
    kind: int
    start_ns: int
    end_ns: int
    status_code: int
    status_message: str
    attributes: dict[str, Any]
    problem: str | None = None  # the span's own bytes are broken: what, for its violation


def first_bad(items: list[Any]) -> BadValue | None:
    """The first undecodable value of a list or kvlist (which then stands for the whole value)."""
    for item in items:
        if type(item) is BadValue:
            return item
    return None
