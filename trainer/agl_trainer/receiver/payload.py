"""An OTLP request body (traces or logs, any encoding, maybe gzip) -> contract-checked records."""

from __future__ import annotations

import zlib
from typing import Final

import msgspec

from agl_trainer.receiver.contract import Record, classify
from agl_trainer.receiver.otlp_logs import decode_logs_json, decode_logs_protobuf, evaluation_spans
from agl_trainer.receiver.wire import DecodeError, RawSpan, decode_json, decode_protobuf

PROTOBUF: Final = "application/x-protobuf"
JSON: Final = "application/json"


class PayloadTooLarge(ValueError):
    """The body (or what it decompresses to) is over the configured limit."""


class DecodedBatch(msgspec.Struct):
    records: list[Record]
    spans: int  # every span in the request, foreign ones included (of a logs request: its evaluation results)
    foreign: int  # spans that are not agl's, ignored
    log_records: int = 0  # of a logs request: every record (those not evaluation results are ignored)


def media_type(content_type: str | None) -> str | None:
    """PROTOBUF, JSON, or None for an unsupported content type."""
    base = (content_type or "").split(";", 1)[0].strip().lower()
    if base in (PROTOBUF, "application/protobuf", "application/octet-stream"):
        return PROTOBUF
    if base == JSON:
        return JSON
    return None


_IN = 64 * 1024  # compressed bytes fed to the inflater at once
_OUT = 1 << 20  # most bytes it may produce per call


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes | bytearray:
    """Undo Content-Encoding (identity, gzip, deflate) without ever holding more than `limit` bytes.

    Inflated a megabyte at a time into one buffer, sized from the gzip trailer when it is within
    the limit: the inflated body exists once (zlib's own output buffer and a join of the parts
    each held it a second time; a 256 MiB body took 2.6x that). A gzip body may hold several
    members (RFC 1952: their concatenation is the content); every member is inflated, so nothing
    a sender compressed in parts is acknowledged and dropped. Bytes after the last member that are
    not another member are refused, as is a truncated stream."""
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding == "x-gzip":  # RFC 9110 8.4.1.3: a recipient treats it as gzip
        encoding = "gzip"
    if encoding not in ("gzip", "deflate"):
        raise DecodeError(f"unsupported content-encoding {encoding!r} (use gzip or none)")
    wbits = 31 if encoding == "gzip" else 15
    hint = int.from_bytes(body[-4:], "little") if encoding == "gzip" and len(body) >= 18 else 0
    out = _Buffer(hint if 0 < hint <= limit else _OUT, limit)
    view = memoryview(body)
    start = 0
    while True:
        inflater = zlib.decompressobj(wbits=wbits)
        try:
            for begin in range(start, len(view), _IN):
                data = view[begin : begin + _IN]
                while data:
                    out.add(inflater.decompress(data, _OUT))
                    data = inflater.unconsumed_tail
                if inflater.eof:
                    break
            out.add(inflater.flush())
        except zlib.error as error:
            raise DecodeError(f"body is not valid {encoding}: {error}") from None
        if not inflater.eof:
            raise DecodeError(f"body is truncated {encoding}")
        rest = inflater.unused_data
        if not rest:
            return out.result()
        if encoding != "gzip":
            raise DecodeError(f"{len(rest)} byte(s) after the end of the {encoding} stream")
        if rest[:2] != b"\x1f\x8b":
            raise DecodeError(f"{len(rest)} byte(s) after the last gzip member are not a gzip member")
        start = len(view) - len(rest)


class _Buffer:
    """Bytes written into one bytearray, grown by doubling; over `limit`: PayloadTooLarge."""

    def __init__(self, capacity: int, limit: int) -> None:
        self.data = bytearray(capacity)
        self.size = 0
        self.limit = limit

    def add(self, chunk: bytes) -> None:
        end = self.size + len(chunk)
        if end > self.limit:
            raise PayloadTooLarge(f"decompressed body is over the limit of {self.limit} bytes")
        if end > len(self.data):
            self.data.extend(bytes(min(self.limit, max(end, 2 * len(self.data))) - len(self.data)))
        self.data[self.size : end] = chunk
        self.size = end

    def result(self) -> bytearray:
        del self.data[self.size :]
        return self.data


def decode_body(body: bytes, media: str) -> DecodedBatch:
    """Decode an uncompressed ExportTraceServiceRequest and classify its spans."""
    return _classified(decode_json(body) if media == JSON else decode_protobuf(body))


def decode_logs_body(body: bytes, media: str) -> DecodedBatch:
    """Decode an uncompressed ExportLogsServiceRequest; its evaluation results are classified as spans."""
    log_records = decode_logs_json(body) if media == JSON else decode_logs_protobuf(body)
    batch = _classified(evaluation_spans(log_records))
    return msgspec.structs.replace(batch, log_records=len(log_records))


def _classified(raw: list[RawSpan]) -> DecodedBatch:
    records: list[Record] = []
    foreign = 0
    for span in raw:
        record = classify(span)
        if record is None:
            foreign += 1
        else:
            records.append(record)
    return DecodedBatch(records=records, spans=len(raw), foreign=foreign)
