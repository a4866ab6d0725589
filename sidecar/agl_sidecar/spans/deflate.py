"""A gzip export request assembled from pieces, a prompt sent again compressed once.

A 35k-token prompt is 200 KB of span, and gzip costs ~1 ns a byte: compressing it is most of what
exporting a call costs. A prompt the sidecar has seen before (`IntArray.shared`: the k attempts of a
task, a retry, a harness that repeats its context) is the same object in every span that carries
it, so its deflate stream is kept (compressed on its own, ended by a full flush, which makes it
byte-aligned and free of references to what came before) and copied into each request. The bytes
around it are compressed as usual, with a full flush before each kept stream so that nothing after
it refers back across it, and the CRC-32 of the whole is combined from the parts' (zlib's
crc32_combine, here in Python: 32 shifts and XORs per kept stream). The result is one ordinary gzip
member that any OTLP receiver inflates to the same request bytes.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

from agl_sidecar.spans import otlp
from agl_sidecar.spans.lru import BytesLRU

_POLY = 0xEDB88320  # CRC-32, reflected
_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # gzip, deflate, no name, no mtime, unknown OS


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (reflected bit order), as zlib's multmodp."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _x2n_table()


def shift_operator(length: int) -> int:
    """x^(8 * length) modulo the polynomial: what crc32_combine multiplies the first CRC by."""
    p = 1 << 31  # x^0
    k = 3
    while length:
        if length & 1:
            p = _multmodp(_X2N[k & 31], p)
        length >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, operator: int) -> int:
    """The CRC-32 of A + B from crc(A), crc(B) and shift_operator(len(B))."""
    return _multmodp(operator, crc1) ^ crc2


class Kept:
    """A shared array's deflate stream, its CRC-32 and length, and the shift for combining."""

    __slots__ = ("crc", "deflated", "length", "operator")

    def __init__(self, data: bytes, level: int) -> None:
        compressor = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
        self.deflated = compressor.compress(data) + compressor.flush(zlib.Z_FULL_FLUSH)
        self.crc = zlib.crc32(data)
        self.length = len(data)
        self.operator = shift_operator(len(data))


def _kept_size(array: otlp.IntArray, kept: Kept) -> int:
    return len(array.elements) + len(kept.deflated)  # the key keeps its elements alive too


class KeptStreams:
    """Kept streams by their array (by identity), bounded by bytes."""

    def __init__(self, max_bytes: int = 8 * 1024 * 1024) -> None:
        self._lru: BytesLRU[otlp.IntArray, Kept] = BytesLRU(max_bytes, _kept_size)

    def get(self, array: otlp.IntArray, level: int) -> Kept:
        kept = self._lru.get(array)
        if kept is None:
            kept = Kept(array.elements, level)
            self._lru.put(array, kept)
        return kept


def gzip_spans(framer: otlp.RequestFramer, spans: Sequence[bytes], level: int, streams: KeptStreams) -> bytes:
    """`gzip.compress(framer.request(spans), level)`, up to the encoder's choices: each shared array
    of a span (`otlp.SharedSpan`) compressed once and kept."""
    pieces = framer.request_pieces(spans)
    if not any(type(piece) is otlp.SharedSpan for piece in pieces):
        return zlib.compress(b"".join(pieces), level, 16 + zlib.MAX_WBITS)
    compressor = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
    out = [_HEADER]
    crc = 0
    size = 0
    fresh: list[bytes] = []  # bytes since the last kept stream

    def flush_fresh(mode: int) -> None:
        nonlocal crc
        for piece in fresh:
            out.append(compressor.compress(piece))
            crc = zlib.crc32(piece, crc)
        fresh.clear()
        out.append(compressor.flush(mode))

    for piece in pieces:
        size += len(piece)
        if type(piece) is not otlp.SharedSpan:
            fresh.append(piece)
            continue
        at = 0
        for offset, array in piece.shared:
            fresh.append(piece[at:offset])
            flush_fresh(zlib.Z_FULL_FLUSH)
            kept = streams.get(array, level)
            out.append(kept.deflated)
            crc = crc32_combine(crc, kept.crc, kept.operator)
            at = offset + kept.length
        fresh.append(piece[at:])
    flush_fresh(zlib.Z_FINISH)
    out.append(struct.pack("<II", crc, size & 0xFFFFFFFF))
    return b"".join(out)
