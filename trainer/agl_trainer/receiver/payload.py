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
    """Undo Content-Encoding (identity, gzip, deflate) without ever holding more than `limit` bytes."""
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise DecodeError(f"unsupported content-encoding {encoding!r} (use gzip or none)")
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as error:
        raise DecodeError(f"body is not valid {encoding}: {error}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise PayloadTooLarge(f"decompressed body is over the limit of {limit} bytes")
    if not inflater.eof:
        raise DecodeError(f"body is truncated {encoding}")
    return out


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
