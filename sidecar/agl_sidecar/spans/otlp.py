"""OTLP protobuf, encoded by hand.

A model call's span carries arrays of tens of thousands of token IDs. Building them as
opentelemetry-proto messages (or through the OTel SDK, which validates every element) costs
milliseconds per call; writing the protobuf wire format directly costs a table lookup per token.
The output is the standard `ExportTraceServiceRequest` that any OTLP receiver decodes.

Field numbers are from opentelemetry/proto/{common,trace,resource}/v1/*.proto.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Sequence
from typing import Union

from agl.semconv import INT64_MAX, INT64_MIN

AttributeValue = Union[str, bool, int, float, "IntArray", "DoubleArray", Sequence[str]]

# Span.kind
SPAN_KIND_INTERNAL = 1
SPAN_KIND_CLIENT = 3
# Status.code
STATUS_UNSET = 0
STATUS_OK = 1
STATUS_ERROR = 2


# Where a span says which of its int attributes were out of range (their values are not sent).
OUT_OF_RANGE_KEY = "agl.export.out_of_range"


class OutOfRange(OverflowError):
    """An int that no protobuf int64/uint64 field can hold: encoding it would write an over-long
    varint that receivers reject or, worse, store wrapped."""


def _varint(value: int) -> bytes:
    if value < 0:
        if value < INT64_MIN:
            raise OutOfRange(f"{value} is below int64")
        value += 1 << 64  # int64 as two's complement, 10 bytes
    elif value >> 64:
        raise OutOfRange(f"{value} is above uint64")
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Lengths and small ints dominate: precomputed encodings for values below 2**14.
_SMALL = [_varint(v) for v in range(1 << 14)]


def varint(value: int) -> bytes:
    if 0 <= value < 16384:
        return _SMALL[value]
    return _varint(value)


_TAGS = [_varint(n << 3 | 2) for n in range(16)]


def _field_bytes(number: int, payload: bytes) -> bytes:
    size = len(payload)
    return _TAGS[number] + (_SMALL[size] if size < 16384 else _varint(size)) + payload


TABLE_LIMIT = 1 << 21


def _fixed_element(value: int) -> bytes:
    """`ArrayValue.values` entry for 0 <= value < 2**21: AnyValue{int_value} with a 3-byte varint.

    Every in-range value is written with this fixed width, canonical or not (protobuf decoders
    accept over-long varints): equal token sequences then have equal bytes whichever path encoded
    them, so prefixes of arrays are prefixes of bytes (prompt references rely on it), and whole
    arrays can be encoded with C-level byte operations (see _fixed_width_elements)."""
    return bytes((0x0A, 0x04, 0x18, (value & 0x7F) | 0x80, ((value >> 7) & 0x7F) | 0x80, value >> 14))


def _int_element(value: int) -> bytes:
    if 0 <= value < TABLE_LIMIT:
        return _fixed_element(value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise OutOfRange(f"token ID {value} is outside int64")
    inner = b"\x18" + varint(value)
    return b"\x0a" + varint(len(inner)) + inner


class _IntElementTable:
    """Encoded entries per token ID, built lazily: short arrays are a lookup per token."""

    def __init__(self) -> None:
        self._table: list[bytes] = []

    def _grow(self, upto: int) -> None:
        start = len(self._table)
        end = min(max(upto + 1, start * 2, 1024), TABLE_LIMIT)
        self._table.extend(_fixed_element(value) for value in range(start, end))

    def encode(self, values: Sequence[int]) -> bytes:
        if not values:
            return b""
        low, high = min(values), max(values)
        if low < 0 or high >= TABLE_LIMIT:
            return b"".join(_int_element(v) for v in values)
        if high >= len(self._table):
            self._grow(high)
        return b"".join(map(self._table.__getitem__, values))


_INT_TABLE = _IntElementTable()

# Whole arrays at C speed: with the fixed width, each value's three varint bytes come from its
# little-endian uint32 bytes x0, x1, x2 through translate tables and big-int ORs, then strided slice
# assignment interleaves them with the constant entry header: about 4x faster than a lookup per
# token for a 35k-token prompt.
_LOW7 = bytes((x & 0x7F) | 0x80 for x in range(256))
_BIT7 = bytes(x >> 7 for x in range(256))
_MID6 = bytes(((x & 0x3F) << 1) | 0x80 for x in range(256))
_HIGH2 = bytes(x >> 6 for x in range(256))
_SHL2 = bytes((x << 2) & 0xFF for x in range(256))
_BELOW_32 = bytes(range(32))
_LITTLE_ENDIAN = array("I", [1]).tobytes() == b"\x01\x00\x00\x00"


def _fixed_width_elements(values: Sequence[int]) -> bytes:
    """`_fixed_element` of every value; raises OverflowError for values outside [0, 2**21)."""
    n = len(values)
    if n == 0:
        return b""
    packed = array("I", values).tobytes()  # OverflowError for negatives or >= 2**32
    if not _LITTLE_ENDIAN:
        raise OverflowError
    x0, x1, x2 = packed[0::4], packed[1::4], packed[2::4]
    if packed[3::4].count(0) != n or x2.translate(None, _BELOW_32):
        raise OverflowError
    v1 = (int.from_bytes(x0.translate(_BIT7)) | int.from_bytes(x1.translate(_MID6))).to_bytes(n)
    v2 = (int.from_bytes(x1.translate(_HIGH2)) | int.from_bytes(x2.translate(_SHL2))).to_bytes(n)
    out = bytearray(6 * n)
    out[0::6] = b"\x0a" * n
    out[1::6] = b"\x04" * n
    out[2::6] = b"\x18" * n
    out[3::6] = x0.translate(_LOW7)
    out[4::6] = v1
    out[5::6] = v2
    return bytes(out)


class IntArray:
    """An int[] attribute value, kept as its encoded `ArrayValue.values` entries: element bytes are
    self-delimiting, so prefixes of arrays are prefixes of these bytes (used for prompt references).
    `shared`: the same object goes into several spans (a prompt seen again), which the exporter then
    compresses once (deflate.py)."""

    __slots__ = ("elements", "length", "shared")

    def __init__(self, elements: bytes, length: int) -> None:
        self.elements = elements
        self.length = length
        self.shared = False

    @classmethod
    def of(cls, values: Sequence[int]) -> IntArray:
        if len(values) < 512:  # short arrays: a table lookup per value beats the fixed costs below
            return cls(_INT_TABLE.encode(values), len(values))
        try:
            return cls(_fixed_width_elements(values), len(values))
        except (OverflowError, ValueError):
            return cls(_INT_TABLE.encode(values), len(values))

    def __add__(self, other: IntArray) -> IntArray:
        return IntArray(self.elements + other.elements, self.length + other.length)

    @classmethod
    def concat(cls, parts: Sequence[IntArray]) -> IntArray:
        if len(parts) == 1:
            return parts[0]
        return cls(b"".join(part.elements for part in parts), sum(part.length for part in parts))


class DoubleArray:
    """A double[] attribute value: each element is `0a 09 21 <8 bytes little-endian>`."""

    __slots__ = ("elements", "length")

    def __init__(self, values: Sequence[float]) -> None:
        n = len(values)
        self.length = n
        packed = array("d", values).tobytes()
        if array("d", [1.0]).tobytes() != struct.pack("<d", 1.0):  # big-endian host
            packed = struct.pack(f"<{n}d", *values)
        out = bytearray(11 * n)
        out[0::11] = b"\x0a" * n
        out[1::11] = b"\x09" * n
        out[2::11] = b"\x21" * n
        for byte in range(8):
            out[3 + byte :: 11] = packed[byte::8]
        self.elements = bytes(out)


def any_value(value: AttributeValue) -> bytes:
    """An encoded AnyValue."""
    if type(value) is str:
        raw = value.encode()
        size = len(raw)
        return b"\x0a" + (_SMALL[size] if size < 16384 else _varint(size)) + raw
    if isinstance(value, bool):
        return b"\x10" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise OutOfRange(f"{value} is outside int64")
        return b"\x18" + varint(value)
    if isinstance(value, float):
        return b"\x21" + struct.pack("<d", value)
    if isinstance(value, IntArray | DoubleArray):
        return _field_bytes(5, value.elements)
    if isinstance(value, list | tuple):
        return _field_bytes(5, b"".join(_field_bytes(1, any_value(item)) for item in value))
    raise TypeError(f"unsupported attribute value {type(value).__name__}")


_KEYS: dict[str, bytes] = {}
_PACK_DOUBLE = struct.Struct("<d").pack


def _key_part(key: str) -> bytes:
    """KeyValue.key, encoded, followed by the tag of KeyValue.value (cached: names are few)."""
    encoded = _KEYS.get(key)
    if encoded is None:
        raw = key.encode()
        encoded = b"\x0a" + varint(len(raw)) + raw + b"\x12"
        if len(_KEYS) < 4096:  # bound the cache anyway
            _KEYS[key] = encoded
    return encoded


def key_value(key: str, value: AttributeValue) -> bytes:
    encoded = any_value(value)
    size = len(encoded)
    return _key_part(key) + (_SMALL[size] if size < 16384 else _varint(size)) + encoded


_PAIRS: dict[tuple[int, str, str], bytes] = {}


def attributes(field_number: int, items: Iterable[tuple[str, AttributeValue]]) -> bytes:
    """Repeated KeyValue under `field_number` (9 in a Span, 1 in a Resource). None values are
    skipped."""
    out: list[bytes] = []
    _attribute_pieces(field_number, items, out)
    return b"".join(out)


def _attribute_pieces(field_number: int, items: Iterable[tuple[str, AttributeValue]], out: list[bytes]) -> None:
    """`attributes()` as pieces appended to `out`. This runs for every attribute of every call:
    string pairs (model, operation, API, upstream...) repeat and are cached encoded; ints and floats
    are encoded inline; an array's elements (200 KB for a 35k-token prompt) are appended as they
    are, behind a header, so a span copies them once, when it is joined."""
    tag = _TAGS[field_number]
    small = _SMALL
    pairs = _PAIRS
    append = out.append
    out_of_range: list[str] = []
    for key, value in items:
        if value is None:
            continue
        kind = type(value)
        if kind is IntArray or kind is DoubleArray:
            elements = value.elements  # type: ignore[union-attr]
            size = len(elements)
            any_size = 1 + len(varint(size)) + size  # AnyValue{array_value}
            head = _key_part(key) + varint(any_size) + b"\x2a" + varint(size)
            append(tag + varint(len(head) + size) + head)
            append(elements)
            continue
        if kind is str:
            cached = pairs.get((field_number, key, value))  # type: ignore[arg-type]
            if cached is not None:
                append(cached)
                continue
            raw = value.encode()  # type: ignore[union-attr]
            size = len(raw)
            encoded = b"\x0a" + (small[size] if size < 16384 else _varint(size)) + raw
        elif kind is int:
            if 0 <= value < 16384:  # type: ignore[operator]
                encoded = b"\x18" + small[value]  # type: ignore[index]
            elif INT64_MIN <= value <= INT64_MAX:  # type: ignore[operator]
                encoded = b"\x18" + _varint(value)  # type: ignore[arg-type]
            else:  # the value is not sent: the span says so, and which key, in OUT_OF_RANGE_KEY
                out_of_range.append(f"{key}={value}"[:200])
                continue
        elif kind is float:
            encoded = b"\x21" + _PACK_DOUBLE(value)
        else:
            encoded = any_value(value)
        size = len(encoded)
        pair = _key_part(key) + (small[size] if size < 16384 else _varint(size)) + encoded
        size = len(pair)
        whole = tag + (small[size] if size < 16384 else _varint(size)) + pair
        if kind is str and len(pairs) < 8192:
            pairs[(field_number, key, value)] = whole  # type: ignore[index]
        append(whole)
    if out_of_range:
        append(_field_bytes(field_number, key_value(OUT_OF_RANGE_KEY, out_of_range)))


# A shared array this size or more is compressed once for all the spans that carry it.
SHARED_MIN_BYTES = 8 * 1024


class SharedSpan(bytes):
    """An encoded span that carries shared arrays: `shared` lists (offset, array) of their elements
    in it, in order."""

    shared: tuple[tuple[int, IntArray], ...]


def _with_shared(pieces: list[bytes], arrays: list[IntArray]) -> bytes:
    """The pieces joined, as a SharedSpan when some are the elements of `arrays`."""
    joined = b"".join(pieces)
    found: list[tuple[int, IntArray]] = []
    offset = 0
    for piece in pieces:
        for array in arrays:
            if piece is array.elements:
                found.append((offset, array))
                break
        offset += len(piece)
    if not found:
        return joined
    out = SharedSpan(joined)
    out.shared = tuple(found)
    return out


def span(
    *,
    trace_id: bytes,
    span_id: bytes,
    parent_span_id: bytes | None,
    name: str,
    kind: int,
    start_ns: int,
    end_ns: int,
    attrs: Iterable[tuple[str, AttributeValue]],
    encoded_attrs: bytes = b"",
    status_code: int = STATUS_UNSET,
    status_message: str = "",
) -> bytes:
    """An encoded Span message (without its field tag: `request()` frames it). `encoded_attrs` are
    attributes already encoded by `attributes(9, ...)`."""
    out = [_field_bytes(1, trace_id), _field_bytes(2, span_id)]
    if parent_span_id:
        out.append(_field_bytes(4, parent_span_id))
    out.append(_field_bytes(5, name.encode()))
    out.append(b"\x30" + varint(kind))
    out.append(b"\x39" + struct.pack("<Q", start_ns))
    out.append(b"\x41" + struct.pack("<Q", end_ns))
    out.append(encoded_attrs)
    attrs = attrs if isinstance(attrs, list) else list(attrs)
    _attribute_pieces(9, attrs, out)
    if status_code:
        status = (_field_bytes(2, status_message.encode()) if status_message else b"") + b"\x18" + varint(status_code)
        out.append(_field_bytes(15, status))
    shared = [
        value for _, value in attrs
        if type(value) is IntArray and value.shared and len(value.elements) >= SHARED_MIN_BYTES
    ]
    return _with_shared(out, shared) if shared else b"".join(out)


class RequestFramer:
    """Frames encoded spans as one ExportTraceServiceRequest for a fixed resource and scope."""

    def __init__(self, resource: dict[str, AttributeValue], scope_name: str, scope_version: str) -> None:
        self._resource = _field_bytes(1, attributes(1, resource.items()))
        self._scope = _field_bytes(1, _field_bytes(1, scope_name.encode()) + _field_bytes(2, scope_version.encode()))

    def overhead(self, span_bytes: bytes) -> int:
        """Bytes one span adds to a request: its tag and length prefix plus the span itself."""
        return 1 + len(varint(len(span_bytes))) + len(span_bytes)

    def request(self, spans: Sequence[bytes]) -> bytes:
        """The request, joined once: spans of 200 KB are copied once, not once per nesting level."""
        return b"".join(self.request_pieces(spans))

    def request_pieces(self, spans: Sequence[bytes]) -> list[bytes]:
        """The request's bytes as pieces: framing, and each span as it is."""
        pieces: list[bytes] = [b"", self._resource, b"", self._scope]
        scope_spans = len(self._scope)
        for span_bytes in spans:
            header = _TAGS[2] + varint(len(span_bytes))
            pieces.append(header)
            pieces.append(span_bytes)
            scope_spans += len(header) + len(span_bytes)
        pieces[2] = _TAGS[2] + varint(scope_spans)
        resource_spans = len(self._resource) + len(pieces[2]) + scope_spans
        pieces[0] = _TAGS[1] + varint(resource_spans)
        return pieces


# --- reading back: the spans of a request this module framed, and the endpoint's answer ----------
def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ValueError("truncated or over-long varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _fields(data: bytes) -> list[tuple[int, int, bytes | int]]:
    """(field number, wire type, value) of one message level; lengths checked, groups refused."""
    out: list[tuple[int, int, bytes | int]] = []
    at = 0
    while at < len(data):
        key, at = _read_varint(data, at)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, at = _read_varint(data, at)
            out.append((number, 0, value))
        elif wire_type == 2:
            size, at = _read_varint(data, at)
            if at + size > len(data):
                raise ValueError("a field runs past the end of the message")
            out.append((number, 2, data[at : at + size]))
            at += size
        elif wire_type in (1, 5):
            width = 8 if wire_type == 1 else 4
            if at + width > len(data):
                raise ValueError("a fixed-width field runs past the end of the message")
            out.append((number, wire_type, data[at : at + width]))
            at += width
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
    return out


def split_request(request: bytes) -> list[bytes]:
    """The encoded spans of an ExportTraceServiceRequest (as `RequestFramer.request` takes them)."""
    spans: list[bytes] = []
    for number, _, resource_spans in _fields(request):
        if number != 1 or not isinstance(resource_spans, bytes):
            continue
        for inner, _, scope_spans in _fields(resource_spans):
            if inner != 2 or not isinstance(scope_spans, bytes):
                continue
            spans += [value for n, _, value in _fields(scope_spans) if n == 2 and isinstance(value, bytes)]
    return spans


def partial_success(body: bytes, json: bool) -> tuple[int, str]:
    """(rejected spans, error message) from an ExportTraceServiceResponse; (0, "") when it has none
    or cannot be read (a 2xx is a success whatever its body)."""
    if not body:
        return 0, ""
    try:
        if json:
            import msgspec

            decoded = msgspec.json.decode(body)
            partial = decoded.get("partialSuccess") or decoded.get("partial_success") or {}
            rejected = partial.get("rejectedSpans", partial.get("rejected_spans", 0))
            return int(rejected or 0), str(partial.get("errorMessage", partial.get("error_message", "")))
        rejected, message = 0, ""
        for number, _, value in _fields(body):
            if number == 1 and isinstance(value, bytes):
                for inner, _, item in _fields(value):
                    if inner == 1 and isinstance(item, int):
                        rejected = item
                    elif inner == 2 and isinstance(item, bytes):
                        message = item.decode(errors="replace")
        return rejected, message
    except Exception:  # noqa: BLE001 - an unreadable answer to an accepted request is still accepted
        return 0, ""
