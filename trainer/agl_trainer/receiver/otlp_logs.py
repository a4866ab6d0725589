"""OTLP logs (`POST /v1/logs`, the LogsService over gRPC) -> the `RawSpan`s of the evaluation results
among them; every other log record is someone else's and ignored.

The GenAI semantic conventions say an evaluation as an *event*: a log record named
`gen_ai.evaluation.result` (the LogRecord's `event_name`, or the older `event.name` attribute) whose
attributes carry `gen_ai.evaluation.name`, `gen_ai.evaluation.score.value` / `.label`, and for agl
`agl.rollout.id`. Each becomes the zero-length span of that name which the contract already reads as
a reward (contract.py `_evaluation`), so the two forms are one rule: its time is the record's
(`time_unix_nano`, else `observed_time_unix_nano`); its trace is the record's, or one derived from
the record when it was emitted outside any span; its parent is the span it was emitted in; its span
id is derived from the record's content, so a batch sent again is a duplicate, not a second reward.

Protobuf is walked by otlp_protobuf.py's `decode_items`, as spans are (a broken record costs only
itself); JSON by otlp_json.py's `JsonExport`, as spans are: one typed msgspec pass, else record by
record with protobuf's JSON spellings.
Logs are rare and small (one record per evaluation), so no fast path beyond that.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

import msgspec
from agl.semconv import EVENT_NAME, SPAN_EVALUATION_RESULT

from agl_trainer.receiver.otlp_json import (
    JsonExport,
    JsonKeyValue,
    LenientKeyValue,
    Number,
    _json_attribute,
    _json_id,
    _json_time,
)
from agl_trainer.receiver.otlp_protobuf import (
    _FIXED64,
    _broken_key_value,
    _fields,
    _IntArray,
    _key_value,
    _text,
    decode_items,
)
from agl_trainer.receiver.raw_span import BadValue, DecodeError, RawSpan

SPAN_KIND_INTERNAL = 1


class LogRecord(msgspec.Struct):
    """The fields of an OTLP LogRecord that an evaluation result needs."""

    time_ns: int
    observed_ns: int
    trace_id: bytes
    span_id: bytes
    event_name: str
    attributes: dict[str, Any]
    problem: str | None = None  # its own bytes are broken


def evaluation_spans(records: list[LogRecord]) -> list[RawSpan]:
    """The records that are evaluation results (or broken ones that said they were), as RawSpans."""
    return [_as_span(record) for record in records if record.problem is not None or is_evaluation(record)]


def is_evaluation(record: LogRecord) -> bool:
    name = record.event_name or record.attributes.get(EVENT_NAME)
    return name == SPAN_EVALUATION_RESULT


def _as_span(record: LogRecord) -> RawSpan:
    digest = _content_digest(record)
    trace_id = record.trace_id or digest[8:24]  # emitted outside any span: a trace of its own
    when = record.time_ns or record.observed_ns
    if record.problem is not None:
        return RawSpan(trace_id, digest[:8], b"", "", 0, 0, 0, 0, "", {}, problem=record.problem)
    attributes = {key: value for key, value in record.attributes.items() if key != EVENT_NAME}
    return RawSpan(
        trace_id=trace_id,
        span_id=digest[:8],
        parent_span_id=record.span_id,
        name=SPAN_EVALUATION_RESULT,
        kind=SPAN_KIND_INTERNAL,
        start_ns=when,
        end_ns=when,
        status_code=0,
        status_message="",
        attributes=attributes,
    )


def _content_digest(record: LogRecord) -> bytes:
    """24 bytes that depend on the record's content only: the same record sent twice (a retry, a
    collector's resend) gets the same span id, so the store keeps it once."""
    hasher = hashlib.blake2b(digest_size=24)
    for part in (record.trace_id, record.span_id, record.event_name.encode("utf-8", "surrogatepass")):
        hasher.update(len(part).to_bytes(4, "little") + part)
    hasher.update(f"{record.time_ns}/{record.observed_ns}/{record.problem}".encode())
    for key in sorted(record.attributes):
        hasher.update(repr((key, _canonical(record.attributes[key]))).encode("utf-8", "surrogatepass"))
    return hasher.digest()


def _canonical(value: Any) -> Any:
    """A value in a form whose repr is the same however it was decoded (numpy arrays as lists)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, list):
        return [_canonical(item) for item in value]
    if isinstance(value, dict):
        return sorted((key, _canonical(item)) for key, item in value.items())
    if isinstance(value, BadValue):
        return ("bad", value.reason)
    return value


# ------------------------------------------------------------------------------------- protobuf
def decode_logs_protobuf(buf: bytes) -> list[LogRecord]:
    """An ExportLogsServiceRequest in protobuf encoding."""
    return decode_items(buf, _log_record, _broken_record)


def _log_record(buf: bytes, start: int, end: int, pending: list) -> LogRecord:
    time_ns = observed_ns = 0
    trace_id = span_id = b""
    event_name = ""
    attributes: dict[str, Any] = {}
    for field, wire, item in _fields(buf, start, end):
        if field == 6 and wire == 2:
            try:
                key, value = _key_value(buf, *item)
            except (DecodeError, RecursionError) as error:
                key, value = _broken_key_value(buf, *item, error)
            if type(value) is _IntArray:
                pending.append((attributes, key, value))
            attributes[key] = value
        elif field == 1 and wire == 1:
            time_ns = _FIXED64.unpack(item)[0]
        elif field == 11 and wire == 1:
            observed_ns = _FIXED64.unpack(item)[0]
        elif field == 9 and wire == 2:
            trace_id = bytes(buf[item[0] : item[1]])
        elif field == 10 and wire == 2:
            span_id = bytes(buf[item[0] : item[1]])
        elif field == 12 and wire == 2:
            event_name = _text(buf, item)
    return LogRecord(time_ns, observed_ns, trace_id, span_id, event_name, attributes)


def _broken_record(buf: bytes, start: int, end: int, error: Exception) -> LogRecord:
    """A record whose bytes are broken inside its own length: kept (as a violation) when it says it
    is an evaluation result, so that a grader's broken reward is reported, not silently dropped."""
    trace_id, event_name = b"", ""
    with contextlib.suppress(DecodeError):
        for field, wire, item in _fields(buf, start, end):
            if field == 9 and wire == 2:
                trace_id = bytes(buf[item[0] : item[1]])
            elif field == 12 and wire == 2:
                event_name = _text(buf, item)
    said = event_name == SPAN_EVALUATION_RESULT or SPAN_EVALUATION_RESULT.encode() in buf[start:end]
    problem = f"undecodable: {error}" if said else None
    return LogRecord(0, 0, trace_id, b"", event_name, {}, problem=problem)


# ----------------------------------------------------------------------------------------- JSON
class JsonLogRecord(msgspec.Struct, forbid_unknown_fields=False):
    timeUnixNano: int | str = 0
    observedTimeUnixNano: int | str = 0
    traceId: str = ""
    spanId: str = ""
    eventName: str = ""
    attributes: list[JsonKeyValue] = []


class LenientLogRecord(msgspec.Struct, forbid_unknown_fields=False):
    timeUnixNano: Number = 0
    observedTimeUnixNano: Number = 0
    traceId: str | None = ""
    spanId: str | None = ""
    eventName: str | None = ""
    attributes: list[LenientKeyValue] | None = []


_LOGS: JsonExport[LogRecord] = JsonExport(
    ("resourceLogs", "scopeLogs", "logRecords"), JsonLogRecord, LenientLogRecord
)


def decode_logs_json(body: bytes) -> list[LogRecord]:
    """An ExportLogsServiceRequest in OTLP JSON: one typed pass, else record by record."""
    return _LOGS.decode(body, _json_record, _broken_json_record)


def _broken_json_record(raw: msgspec.Raw, error: Exception) -> LogRecord:
    """Kept (as a violation) only when it says it is an evaluation result, as `_broken_record`."""
    said = SPAN_EVALUATION_RESULT.encode() in bytes(raw)
    problem = f"undecodable: {str(error)[:200]}" if said else None
    return LogRecord(0, 0, b"", b"", "", {}, problem=problem)


def _json_record(record: JsonLogRecord | LenientLogRecord) -> LogRecord:
    return LogRecord(
        time_ns=_json_time(record.timeUnixNano),
        observed_ns=_json_time(record.observedTimeUnixNano),
        trace_id=_json_id(record.traceId),
        span_id=_json_id(record.spanId),
        event_name=record.eventName or "",
        attributes={kv.key or "": _json_attribute(kv.value) for kv in record.attributes or ()},
    )
