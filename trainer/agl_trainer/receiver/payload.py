"""An OTLP request body (any encoding, maybe gzip) -> contract-checked records."""

from __future__ import annotations

import zlib
from typing import Final

import msgspec

from agl_trainer.receiver.contract import Record, classify
from agl_trainer.receiver.wire import DecodeError, decode_json, decode_protobuf

PROTOBUF: Final = "application/x-protobuf"
JSON: Final = "application/json"


class PayloadTooLarge(ValueError):
    """The body (or what it decompresses to) is over the configured limit."""


class DecodedBatch(msgspec.Struct):
    records: list[Record]
    spans: int  # every span in the request, foreign ones included
    foreign: int  # spans that are not agl's, ignored


def media_type(content_type: str | None) -> str | None:
    """PROTOBUF, JSON, or None for an unsupported content type."""
    base = (content_type or "").split(";", 1)[0].strip().lower()
    if base in (PROTOBUF, "application/protobuf", "application/octet-stream"):
        return PROTOBUF
    if base == JSON:
        return JSON
    return None


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo Content-Encoding (identity, gzip, deflate) without ever holding more than `limit` bytes.

    A gzip body may hold several members (RFC 1952: their concatenation is the content); every
    member is inflated, so nothing a sender compressed in parts is acknowledged and dropped. Bytes
    after the last member that are not another member are refused, as is a truncated stream."""
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding == "x-gzip":  # RFC 9110 8.4.1.3: a recipient treats it as gzip
        encoding = "gzip"
    if encoding not in ("gzip", "deflate"):
        raise DecodeError(f"unsupported content-encoding {encoding!r} (use gzip or none)")
    wbits = 31 if encoding == "gzip" else 15
    parts: list[bytes] = []
    size = 0
    rest = body
    while True:
        inflater = zlib.decompressobj(wbits=wbits)
        try:
            out = inflater.decompress(rest, limit - size + 1)
        except zlib.error as error:
            raise DecodeError(f"body is not valid {encoding}: {error}") from None
        size += len(out)
        parts.append(out)
        if size > limit or inflater.unconsumed_tail:
            raise PayloadTooLarge(f"decompressed body is over the limit of {limit} bytes")
        if not inflater.eof:
            raise DecodeError(f"body is truncated {encoding}")
        rest = inflater.unused_data
        if not rest:
            return b"".join(parts) if len(parts) > 1 else parts[0]
        if encoding != "gzip":
            raise DecodeError(f"{len(rest)} byte(s) after the end of the {encoding} stream")
        if rest[:2] != b"\x1f\x8b":
            raise DecodeError(f"{len(rest)} byte(s) after the last gzip member are not a gzip member")


def decode_body(body: bytes, media: str) -> DecodedBatch:
    """Decode an uncompressed ExportTraceServiceRequest and classify its spans."""
    raw = decode_json(body) if media == JSON else decode_protobuf(body)
    records: list[Record] = []
    foreign = 0
    for span in raw:
        record = classify(span)
        if record is None:
            foreign += 1
        else:
            records.append(record)
    return DecodedBatch(records=records, spans=len(raw), foreign=foreign)
