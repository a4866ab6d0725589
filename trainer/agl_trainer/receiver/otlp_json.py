"""OTLP JSON (https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding) -> `RawSpan`s, through
msgspec structs; attribute values are decoded lazily, one at a time, so a bad one stays in its attribute."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from agl_trainer.receiver import json_split
from agl_trainer.receiver.raw_span import MAX_VALUE_DEPTH, BadValue, DecodeError, RawSpan, first_bad


# Proto3's JSON mapping accepts null for any field (the field's default) and an integral number
# for an int64 (`1.0`, `1e3`: what protobuf's own parsers take). The request is decoded in one typed
# pass (the fast path, the spelling exporters write); when that fails, span by span with every field
# taking those spellings too (the slow path), so a sender spelling its JSON so costs nothing and a
# span of the wrong shape (attributes an object, a string for a span) is refused alone.
Number = int | float | str | None
Item = TypeVar("Item")


class JsonArrayValue(msgspec.Struct, forbid_unknown_fields=False):
    values: list[JsonAnyValue | None] | None = []


class JsonKeyValueList(msgspec.Struct, forbid_unknown_fields=False):
    values: list[LenientKeyValue] | None = []


class JsonAnyValue(msgspec.Struct, forbid_unknown_fields=False):
    stringValue: str | None = None
    boolValue: bool | None = None
    intValue: Number = None
    doubleValue: float | str | None = None
    arrayValue: JsonArrayValue | None = None
    kvlistValue: JsonKeyValueList | None = None
    bytesValue: str | None = None


class JsonKeyValue(msgspec.Struct, forbid_unknown_fields=False):
    key: str
    value: msgspec.Raw = msgspec.Raw()  # decoded on its own (_JSON_VALUE): a bad value costs only itself


class JsonStatus(msgspec.Struct, forbid_unknown_fields=False):
    code: int | str = 0
    message: str = ""


class JsonSpan(msgspec.Struct, forbid_unknown_fields=False):
    traceId: str = ""
    spanId: str = ""
    parentSpanId: str = ""
    name: str = ""
    kind: int | str = 0
    startTimeUnixNano: int | str = 0
    endTimeUnixNano: int | str = 0
    attributes: list[JsonKeyValue] = []
    status: JsonStatus | None = None


# --- the slow path's spellings ---
class LenientKeyValue(msgspec.Struct, forbid_unknown_fields=False):
    key: str | None = ""
    value: msgspec.Raw = msgspec.Raw()


class LenientStatus(msgspec.Struct, forbid_unknown_fields=False):
    code: Number = 0
    message: str | None = ""


class LenientSpan(msgspec.Struct, forbid_unknown_fields=False):
    traceId: str | None = ""
    spanId: str | None = ""
    parentSpanId: str | None = ""
    name: str | None = ""
    kind: Number = 0
    startTimeUnixNano: Number = 0
    endTimeUnixNano: Number = 0
    attributes: list[LenientKeyValue] | None = []
    status: LenientStatus | None = None


_JSON_VALUE = msgspec.json.Decoder(JsonAnyValue | None)
_KINDS = {
    "SPAN_KIND_UNSPECIFIED": 0,
    "SPAN_KIND_INTERNAL": 1,
    "SPAN_KIND_SERVER": 2,
    "SPAN_KIND_CLIENT": 3,
    "SPAN_KIND_PRODUCER": 4,
    "SPAN_KIND_CONSUMER": 5,
}
_STATUS = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


def _json_int(value: int | float | str | None) -> int | None:
    """An OTLP JSON integer (a number, or a decimal string as the JSON mapping writes int64s); an
    integral float is that integer (protobuf's JSON parsers take `1.0`), any other float is not."""
    if type(value) is int:
        return value
    if value is None:
        return 0
    if type(value) is float:
        return int(value) if value.is_integer() else None
    try:
        return int(value)
    except ValueError:
        return None


def _json_int64(value: int | float | str) -> int | BadValue:
    number = _json_int(value)
    if number is None:
        return BadValue("not_int", f"intValue {str(value)[:40]!r} is not an integer")
    if not -(1 << 63) <= number < 1 << 63:
        return BadValue("int_out_of_range", f"intValue {str(value)[:40]} is outside int64")
    return number


def _json_attribute(raw: msgspec.Raw, depth: int = 0) -> Any:
    """A KeyValue's value, decoded on its own: whatever is wrong with it is a BadValue of its own."""
    if not raw:  # absent
        return None
    if depth > MAX_VALUE_DEPTH:
        return BadValue("nesting_too_deep", f"values nested deeper than {MAX_VALUE_DEPTH} levels")
    try:
        value = _JSON_VALUE.decode(raw)
    except RecursionError:
        return BadValue("nesting_too_deep", f"values nested deeper than {MAX_VALUE_DEPTH} levels")
    except msgspec.DecodeError as error:
        return BadValue("malformed", str(error))
    return _json_value(value, depth)


def _json_value(value: JsonAnyValue | None, depth: int) -> Any:
    if value is None:
        return None
    if depth > MAX_VALUE_DEPTH:
        return BadValue("nesting_too_deep", f"values nested deeper than {MAX_VALUE_DEPTH} levels")
    if value.stringValue is not None:
        return value.stringValue
    if value.intValue is not None:
        return _json_int64(value.intValue)
    if value.boolValue is not None:
        return value.boolValue
    if value.doubleValue is not None:
        try:
            return float(value.doubleValue)
        except ValueError:
            return BadValue("not_number", f"doubleValue {str(value.doubleValue)[:40]!r} is not a number")
    if value.arrayValue is not None:
        items = [_json_value(item, depth + 1) for item in value.arrayValue.values or ()]
        bad = first_bad(items)
        if bad is not None:
            return bad
        if items and all(type(item) is int for item in items):
            return np.array(items, dtype=np.int64)  # every item is in int64 (_json_int64)
        if items and all(type(item) is float for item in items):
            return np.array(items, dtype=np.float64)
        return items
    if value.kvlistValue is not None:
        entries = {}
        for kv in value.kvlistValue.values or ():
            item = _json_attribute(kv.value, depth + 1)
            if type(item) is BadValue:
                return item
            entries[kv.key or ""] = item
        return entries
    if value.bytesValue is not None:
        try:
            return base64.b64decode(value.bytesValue, validate=True)
        except (binascii.Error, ValueError):
            return BadValue("bad_base64", "bytesValue is not base64")
    return None


def _json_id(value: str | None) -> bytes:
    """A trace or span id: hex, as the OTLP JSON encoding writes it; base64, as a generic protobuf
    JSON mapping would, is accepted too. Anything else is b"" (the contract's bad_ids)."""
    if not value:
        return b""
    try:
        return bytes.fromhex(value)
    except ValueError:
        pass
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return b""


def _enum(value: int | float | str | None, names: dict[str, int]) -> int:
    """An enum given as a number or its name; -1 when it is neither (the contract decides)."""
    if type(value) is str and value in names:
        return names[value]
    number = _json_int(value)
    return -1 if number is None else number


def _json_time(value: int | float | str | None) -> int:
    """A fixed64 time; -1 (which the contract refuses) when it is not an integer."""
    number = _json_int(value)
    return -1 if number is None else number


class JsonExport(Generic[Item]):
    """One signal's OTLP JSON export request, decoded in one typed pass; when that fails, item by
    item with protobuf's other JSON spellings (`lenient_item`), so that an item of the wrong shape
    is refused alone (`broken` says what it becomes). When the JSON parser itself refuses the
    request (a lone surrogate escape in one string, values nested past its depth), the request is
    split into its items without parsing them (json_split.py), and an item the parser refuses is
    decoded field by field: what it cannot read costs only its attribute (a BadValue) or, past that,
    its item. A request whose own frame is wrong is refused."""

    def __init__(self, names: tuple[str, str, str], typed_item: type, lenient_item: type) -> None:
        self._names = names
        self._typed = msgspec.json.Decoder(_frame(names, typed_item, nullable=False))
        self._raw = msgspec.json.Decoder(_frame(names, msgspec.Raw, nullable=True))  # each item on its own
        self._lenient = msgspec.json.Decoder(lenient_item)
        self._lenient_item = lenient_item
        self._item_fields = {field.encode_name for field in msgspec.structs.fields(lenient_item)} - {"attributes"}

    def decode(
        self, body: bytes, convert: Callable[[Any], Item], broken: Callable[[msgspec.Raw, Exception], Item]
    ) -> list[Item]:
        try:
            request = self._typed.decode(body)
        except msgspec.ValidationError as error:
            return self._item_by_item(body, error, convert, broken)
        except (msgspec.DecodeError, RecursionError):  # the parser's refusal: maybe one item's, maybe the frame's
            return [self._one(item, convert, broken) for item in json_split.items(body, self._names)]
        return [
            convert(item)
            for resource in request.resources
            for scope in resource.scopes
            for item in scope.items
        ]

    def _item_by_item(
        self,
        body: bytes,
        typed_error: msgspec.ValidationError,
        convert: Callable[[Any], Item],
        broken: Callable[[msgspec.Raw, Exception], Item],
    ) -> list[Item]:
        try:
            request = self._raw.decode(body)
        except msgspec.ValidationError:  # the request's own frame: nothing to keep
            raise DecodeError(f"invalid OTLP JSON: {typed_error}") from None
        except (msgspec.DecodeError, RecursionError):
            return [self._one(item, convert, broken) for item in json_split.items(body, self._names)]
        return [
            self._one(raw, convert, broken)
            for resource in request.resources or ()
            for scope in resource.scopes or ()
            for raw in scope.items or ()
        ]

    def _one(
        self, raw: bytes | msgspec.Raw, convert: Callable[[Any], Item], broken: Callable[[msgspec.Raw, Exception], Item]
    ) -> Item:
        try:
            item = self._lenient.decode(raw)
        except (msgspec.DecodeError, RecursionError) as error:  # this item only
            if isinstance(error, msgspec.ValidationError):  # the wrong shape: refused alone
                return broken(msgspec.Raw(raw), error)
            try:
                item = self._by_field(bytes(raw))
            except (DecodeError, msgspec.DecodeError, RecursionError, ValueError):
                return broken(msgspec.Raw(raw), error)
        return convert(item)

    def _by_field(self, raw: bytes) -> Any:
        """The lenient item from its fields decoded one by one: its own fields by Python's json (it
        keeps a lone surrogate, which the contract then refuses as not UTF-8), its attributes'
        values left as Raw for `_json_attribute` (what it cannot decode is that attribute's BadValue)."""
        plain: dict[str, Any] = {}
        attributes: list[LenientKeyValue] = []
        for name, (start, stop) in json_split.fields(raw):
            if name == "attributes":
                attributes = [_key_value(raw, where) for where in json_split.elements(raw, (start, stop))]
            elif name in self._item_fields:
                plain[name] = json_split.loads(raw[start:stop])
        item = msgspec.convert(plain, self._lenient_item)
        item.attributes = attributes
        return item


def _key_value(raw: bytes, where: tuple[int, int]) -> LenientKeyValue:
    key, value = "", msgspec.Raw()
    for name, (start, stop) in json_split.fields(raw, where):
        if name == "key":
            key = json_split.loads(raw[start:stop])
            if key is None:  # null: the default, as the lenient pass takes it
                key = ""
            elif not isinstance(key, str):
                raise ValueError("an attribute key is not a string")
        elif name == "value":
            value = msgspec.Raw(raw[start:stop])
    return LenientKeyValue(key, value)


def _frame(names: tuple[str, str, str], item: Any, nullable: bool) -> Any:
    """The export request around its items, the same for every signal but for its names:
    {"resourceSpans": [{"scopeSpans": [{"spans": [item, ...]}]}]} for traces. Its levels read as
    `.resources`, `.scopes`, `.items` whatever the signal calls them; each may be absent ([]) and,
    with `nullable`, null."""
    inner = item
    for level, name in reversed(tuple(zip(("resources", "scopes", "items"), names, strict=True))):
        kind = list[inner] | None if nullable else list[inner]  # type: ignore[valid-type]
        fields = [(level, kind, [])]
        inner = msgspec.defstruct(name, fields, rename={level: name}, forbid_unknown_fields=False)
    return inner


_SPANS: JsonExport[RawSpan] = JsonExport(("resourceSpans", "scopeSpans", "spans"), JsonSpan, LenientSpan)


def decode_json(body: bytes) -> list[RawSpan]:
    """Decode an OTLP ExportTraceServiceRequest in JSON encoding."""
    return _SPANS.decode(body, _raw_span, _broken_span)


def _broken_span(raw: msgspec.Raw, error: Exception) -> RawSpan:
    problem = f"undecodable: {str(error)[:200]}"
    return RawSpan(b"", b"", b"", "", 0, 0, 0, 0, "", {}, problem=problem)


def _raw_span(span: JsonSpan | LenientSpan) -> RawSpan:
    status = span.status
    return RawSpan(
        trace_id=_json_id(span.traceId),
        span_id=_json_id(span.spanId),
        parent_span_id=_json_id(span.parentSpanId),
        name=span.name or "",
        kind=_enum(span.kind, _KINDS),
        start_ns=_json_time(span.startTimeUnixNano),
        end_ns=_json_time(span.endTimeUnixNano),
        status_code=0 if status is None else _enum(status.code, _STATUS),
        status_message=(status.message or "") if status is not None else "",
        attributes={kv.key or "": _json_attribute(kv.value) for kv in span.attributes or ()},
    )
