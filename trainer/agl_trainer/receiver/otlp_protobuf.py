"""OTLP protobuf -> `RawSpan`s, walking the wire format directly instead of building
opentelemetry-proto messages: a span's token arrays are thousands of `AnyValue{int_value}` messages,
and turning each into a Python object is what makes a naive receiver slow. Int and double arrays are
decoded with numpy over the raw bytes (`arrays.py`); everything else is a few fields per span."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from agl_trainer.receiver.arrays import decode_double_array, decode_int_array, decode_int_arrays
from agl_trainer.receiver.raw_span import MAX_VALUE_DEPTH, UINT64_MAX, BadValue, DecodeError, RawSpan, first_bad


_FIXED64 = struct.Struct("<Q")
_DOUBLE = struct.Struct("<d")
T = TypeVar("T")


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise DecodeError(f"truncated varint at byte {pos}")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise DecodeError(f"varint longer than 10 bytes at byte {pos}")


def _fields(buf: bytes, pos: int, end: int):
    """Yield (field number, wire type, value) over a message; length-delimited values as (start, end)."""
    while pos < end:
        key, pos = _varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield field, 0, value
        elif wire == 2:
            length, pos = _varint(buf, pos, end)
            stop = pos + length
            if stop > end:
                raise DecodeError(f"field {field}: length {length} runs past the end at byte {pos}")
            yield field, 2, (pos, stop)
            pos = stop
        elif wire == 1:
            if pos + 8 > end:
                raise DecodeError(f"truncated fixed64 at byte {pos}")
            yield field, 1, buf[pos : pos + 8]
            pos += 8
        elif wire == 5:
            if pos + 4 > end:
                raise DecodeError(f"truncated fixed32 at byte {pos}")
            yield field, 5, buf[pos : pos + 4]
            pos += 4
        else:
            raise DecodeError(f"unsupported wire type {wire} (field {field}) at byte {pos}")


def _text(buf: bytes, span: tuple[int, int]) -> str:
    try:
        return str(memoryview(buf)[span[0] : span[1]], "utf-8")  # no copy of the bytes first
    except UnicodeDecodeError as error:
        raise DecodeError(f"invalid UTF-8 in a string at byte {span[0]}: {error.reason}") from None


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _any_value(buf: bytes, start: int, end: int, depth: int = 0) -> Any:
    if depth > MAX_VALUE_DEPTH:
        return BadValue("nesting_too_deep", f"values nested deeper than {MAX_VALUE_DEPTH} levels")
    value: Any = None
    for field, wire, item in _fields(buf, start, end):
        if field == 1 and wire == 2:
            value = _text(buf, item)
        elif field == 2 and wire == 0:
            value = bool(item)
        elif field == 3 and wire == 0:
            value = _int64(item)
        elif field == 4 and wire == 1:
            value = _DOUBLE.unpack(item)[0]
        elif field == 5 and wire == 2:
            value = _array(buf, *item, depth + 1)
        elif field == 6 and wire == 2:
            value = _kvlist(buf, *item, depth + 1)
        elif field == 7 and wire == 2:
            value = bytes(buf[item[0] : item[1]])
    return value


def _int64(varint: int) -> int | BadValue:
    """A decoded int_value varint as int64; one over 64 bits (no valid encoder writes it) is bad."""
    if varint > UINT64_MAX:
        return BadValue("int_out_of_range", "an int_value varint over 64 bits")
    return _signed(varint)


def _kvlist(buf: bytes, start: int, end: int, depth: int) -> Any:
    value: dict[str, Any] = {}
    for key, item in _key_values(buf, start, end, depth):
        if type(item) is BadValue:
            return item
        value[key] = item
    return value


def _array(buf: bytes, start: int, end: int, depth: int = 1) -> Any:
    inner_tag = buf[start + 2] if end - start > 2 else None  # the first element's value field
    if inner_tag == 0x21:
        doubles = decode_double_array(buf, start, end)
        if doubles is not None:
            return doubles
    elif inner_tag == 0x18:
        ints = decode_int_array(buf, start, end)
        if ints is not None:
            return ints
    if depth > MAX_VALUE_DEPTH:
        return BadValue("nesting_too_deep", f"values nested deeper than {MAX_VALUE_DEPTH} levels")
    items = [
        _any_value(buf, *item, depth)
        for field, wire, item in _fields(buf, start, end)
        if field == 1 and wire == 2
    ]
    bad = first_bad(items)
    if bad is not None:
        return bad
    if items and all(type(item) is int for item in items):
        return np.array(items, dtype=np.int64)
    if items and all(type(item) is float for item in items):
        return np.array(items, dtype=np.float64)
    return items


def _key_values(buf: bytes, start: int, end: int, depth: int):
    for field, wire, item in _fields(buf, start, end):
        if field == 1 and wire == 2:  # KeyValue
            key, value = "", None
            for kv_field, kv_wire, kv_item in _fields(buf, *item):
                if kv_field == 1 and kv_wire == 2:
                    key = _text(buf, kv_item)
                elif kv_field == 2 and kv_wire == 2:
                    value = _any_value(buf, *kv_item, depth)
            yield key, value


class _IntArray:
    """An int array left in the buffer, decoded with every other one of the request at the end."""

    __slots__ = ("end", "start")

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end


def _attribute_value(buf: bytes, start: int, end: int) -> Any:
    """A span attribute's AnyValue, with fast paths for a lone scalar; an array that looks like ints
    is deferred (see _IntArray). Anything unusual takes the generic path."""
    if end - start < 2:
        return _any_value(buf, start, end)
    tag = buf[start]
    if tag == 0x18:  # int_value
        if end - start == 2 and buf[start + 1] < 0x80:
            return buf[start + 1]
        value, pos = _varint(buf, start + 1, end)
        if pos == end:
            return _int64(value)
    elif tag == 0x0A or tag == 0x2A:  # string_value, array_value
        length = buf[start + 1]
        if length < 0x80:
            body = start + 2
        else:
            length, body = _varint(buf, start + 1, end)
        if body + length == end:
            if tag == 0x0A:
                return _text(buf, (body, end))
            if length >= 4 and buf[body] == 0x0A and buf[body + 2] == 0x18:
                return _IntArray(body, end)
            return _array(buf, body, end)
    elif tag == 0x21 and end - start == 9:  # double_value
        return _DOUBLE.unpack_from(buf, start + 1)[0]
    elif tag == 0x10 and end - start == 2:  # bool_value
        return bool(buf[start + 1])
    return _any_value(buf, start, end)


def _broken_key_value(buf: bytes, pos: int, end: int, error: Exception) -> tuple[str, BadValue]:
    """A KeyValue whose value could not be decoded: its key and a BadValue (the value's bytes are
    bounded by the KeyValue's length, so nothing past it is affected); a broken key is a DecodeError."""
    key = _key_only(buf, pos, end)
    if isinstance(error, RecursionError):  # bounded by MAX_VALUE_DEPTH; a guard for a deep stack
        return key, BadValue("nesting_too_deep", "values nested too deep")
    return key, BadValue("invalid_utf8" if "UTF-8" in str(error) else "malformed", str(error))


def _key_only(buf: bytes, pos: int, end: int) -> str:
    """The key of a KeyValue whose value is broken; raises DecodeError if the key itself is."""
    for field, wire, item in _fields(buf, pos, end):
        if field == 1 and wire == 2:
            return _text(buf, item)
    return ""


def _key_value(buf: bytes, pos: int, end: int) -> tuple[str, Any]:
    """A KeyValue (key = 1, value = 2, both length-delimited), without the generic field walk."""
    key, value = "", None
    origin = pos
    while pos < end:
        tag = buf[pos]
        if tag != 0x0A and tag != 0x12:
            break  # an unexpected field: take the generic path for this KeyValue
        if pos + 1 < end and buf[pos + 1] < 0x80:
            length, pos = buf[pos + 1], pos + 2
        else:
            length, pos = _varint(buf, pos + 1, end)
        stop = pos + length
        if stop > end:
            raise DecodeError(f"attribute: length {length} runs past the end at byte {pos}")
        if tag == 0x0A:
            key = _text(buf, (pos, stop))
        else:
            value = _attribute_value(buf, pos, stop)
        pos = stop
    else:
        return key, value
    for field, wire, item in _fields(buf, origin, end):
        if field == 1 and wire == 2:
            key = _text(buf, item)
        elif field == 2 and wire == 2:
            value = _attribute_value(buf, *item)
    return key, value


def _resolve(buf: bytes, pending: list[tuple[dict[str, Any], str, _IntArray]]) -> None:
    decoded = decode_int_arrays(buf, [(item.start, item.end) for _, _, item in pending])
    for (attributes, key, item), values in zip(pending, decoded, strict=True):
        if attributes.get(key) is not item:
            continue  # the key came again later in the span: the last value wins, as for any other
        if values is None:
            try:
                values = _array(buf, item.start, item.end)
            except DecodeError as error:  # bounded by its KeyValue: only this attribute is bad
                values = BadValue("malformed", str(error))
        attributes[key] = values


def _span(buf: bytes, start: int, end: int, pending: list) -> RawSpan:
    trace_id = span_id = parent = b""
    name, kind, start_ns, end_ns, code, message = "", 0, 0, 0, 0, ""
    attributes: dict[str, Any] = {}
    pos = start
    while pos < end:  # the field walk, inlined: a span has dozens of fields
        key = buf[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = _varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 2:
            if pos < end and buf[pos] < 0x80:
                length, pos = buf[pos], pos + 1
            else:
                length, pos = _varint(buf, pos, end)
            stop = pos + length
            if stop > end:
                raise DecodeError(f"span field {field}: length {length} runs past the end at byte {pos}")
            if field == 9:
                try:
                    attribute, value = _key_value(buf, pos, stop)
                except (DecodeError, RecursionError) as error:
                    attribute, value = _broken_key_value(buf, pos, stop, error)
                if type(value) is _IntArray:
                    pending.append((attributes, attribute, value))
                attributes[attribute] = value
            elif field == 1:
                trace_id = bytes(buf[pos:stop])
            elif field == 2:
                span_id = bytes(buf[pos:stop])
            elif field == 4:
                parent = bytes(buf[pos:stop])
            elif field == 5:
                name = _text(buf, (pos, stop))
            elif field == 15:
                for st_field, st_wire, st_item in _fields(buf, pos, stop):
                    if st_field == 2 and st_wire == 2:
                        message = _text(buf, st_item)
                    elif st_field == 3 and st_wire == 0:
                        code = st_item
            pos = stop
        elif wire == 1:
            if pos + 8 > end:
                raise DecodeError(f"truncated fixed64 at byte {pos}")
            if field == 7:
                start_ns = _FIXED64.unpack_from(buf, pos)[0]
            elif field == 8:
                end_ns = _FIXED64.unpack_from(buf, pos)[0]
            pos += 8
        elif wire == 0:
            value, pos = _varint(buf, pos, end)
            if field == 6:
                kind = value
        elif wire == 5:
            if pos + 4 > end:
                raise DecodeError(f"truncated fixed32 at byte {pos}")
            pos += 4
        else:
            raise DecodeError(f"unsupported wire type {wire} (field {field}) at byte {pos}")
    return RawSpan(trace_id, span_id, parent, name, kind, start_ns, end_ns, code, message, attributes)


def export_items(buf: bytes) -> Iterator[tuple[int, int]]:
    """The byte range of each item of an OTLP export request: spans of an ExportTraceServiceRequest,
    log records of an ExportLogsServiceRequest (both resource_* = 1 > scope_* = 2 > items = 2; the
    resource and scope are not needed)."""
    for field, wire, item in _fields(buf, 0, len(buf)):
        if field != 1 or wire != 2:
            continue
        for resource_field, resource_wire, resource_item in _fields(buf, *item):
            if resource_field != 2 or resource_wire != 2:
                continue
            for scope_field, scope_wire, scope_item in _fields(buf, *resource_item):
                if scope_field == 2 and scope_wire == 2:
                    yield scope_item


# An item's decoder gets the request, the item's byte range and the list its int arrays wait in (to be
# decoded together, `_resolve`); a broken item's gets the error instead.
ItemDecoder = Callable[[bytes, int, int, list], T]
BrokenItem = Callable[[bytes, int, int, Exception], T]


def decode_items(buf: bytes, item: ItemDecoder[T], broken: BrokenItem[T]) -> list[T]:
    """Each item of an export request, decoded by `item`; one whose bytes are broken inside its own
    length becomes `broken`'s, so that it costs no other item of the request."""
    items: list[T] = []
    pending: list[tuple[dict[str, Any], str, _IntArray]] = []
    for start, end in export_items(buf):
        mark = len(pending)
        try:
            items.append(item(buf, start, end, pending))
        except (DecodeError, RecursionError) as error:
            del pending[mark:]  # its deferred arrays belong to an item that is not kept
            items.append(broken(buf, start, end, error))
    _resolve(buf, pending)
    return items


def decode_protobuf(buf: bytes) -> list[RawSpan]:
    """Decode an OTLP ExportTraceServiceRequest in protobuf encoding."""
    return decode_items(buf, _span, _broken_span)


def _broken_span(buf: bytes, start: int, end: int, error: Exception) -> RawSpan:
    """A span whose bytes are broken inside its own length, with `problem` set (and its ids when
    they can be read), so that it costs no other span of the request."""
    trace_id = span_id = b""
    with contextlib.suppress(DecodeError):
        for field, wire, item in _fields(buf, start, end):
            if field == 1 and wire == 2:
                trace_id = bytes(buf[item[0] : item[1]])
            elif field == 2 and wire == 2:
                span_id = bytes(buf[item[0] : item[1]])
    return RawSpan(trace_id, span_id, b"", "", 0, 0, 0, 0, "", {}, problem=f"undecodable: {error}")
