"""Token IDs from the engine's JSON to encoded OTLP int arrays, a slice at a time.

Decoding and encoding 35k token IDs costs ~2.5 ms of CPU. The span builder does it in slices of a
few thousand IDs (a step of a generator each, so the loop can serve calls between them), and keeps
the encoding of each full-size slice in an LRU keyed by the slice's JSON text: an agent resends its
whole conversation on every turn, so every slice but the last few repeats one already encoded (by
this rollout or another with the same system prompt), and costs a hash instead of a decode.
Slices are cut at the first comma after a fixed size, so equal leading IDs give equal leading slices.
"""

from __future__ import annotations

from collections.abc import Generator

from msgspec import Raw

from agl_sidecar.spans import otlp
from agl_sidecar.calls import wire
from agl_sidecar.spans.lru import BytesLRU

SLICE_TOKENS = 2048  # ~0.15 ms to decode and encode
SLICE_JSON_BYTES = 12 * 1024  # about 2k token IDs of JSON text


class SliceCache:
    """Encoded int-array slices by their JSON text; an LRU bounded by bytes (text + encoding)."""

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        self._lru: BytesLRU[bytes, otlp.IntArray] = BytesLRU(max_bytes, _slice_size)
        self.hits = 0
        self.misses = 0

    @property
    def bytes(self) -> int:
        return self._lru.bytes

    def get(self, text: bytes) -> otlp.IntArray | None:
        found = self._lru.get(text)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        return found

    def put(self, text: bytes, encoded: otlp.IntArray) -> None:
        self._lru.put(text, encoded)


def _slice_size(text: bytes, encoded: otlp.IntArray) -> int:
    return len(text) + len(encoded.elements)


def encode_token_ids(
    value: list[int] | Raw, cache: SliceCache
) -> Generator[None, None, otlp.IntArray | None]:
    """`value` (IDs, or the engine's JSON array) as an encoded int array, yielding between slices;
    None when the engine sent null. Raises msgspec.ValidationError for anything but an int array."""
    parts: list[otlp.IntArray] = []
    if isinstance(value, list):
        if len(value) <= SLICE_TOKENS:
            return otlp.IntArray.of(value)
        for start in range(0, len(value), SLICE_TOKENS):
            parts.append(otlp.IntArray.of(value[start : start + SLICE_TOKENS]))
            yield
        return otlp.IntArray.concat(parts)
    for text, full_size in wire.int_array_pieces(value, SLICE_JSON_BYTES):
        encoded = cache.get(text) if full_size else None
        if encoded is None:
            ids = wire.token_ids(text)
            if ids is None:
                return None
            encoded = otlp.IntArray.of(ids)
            if full_size:
                cache.put(text, encoded)
            yield
        parts.append(encoded)
    return otlp.IntArray.concat(parts) if parts else otlp.IntArray(b"", 0)
