"""Token IDs from the engine's JSON to encoded OTLP int arrays, a slice at a time.

Decoding and encoding 35k token IDs costs ~2.5 ms of CPU. The span builder does it in slices of a
few thousand IDs (a step of a generator each, so the loop can serve calls between them), and keeps
the encoding of each full-size slice in an LRU keyed by the slice's JSON text: an agent resends its
whole conversation on every turn, so every slice but the last few repeats one already encoded (by
this rollout or another with the same system prompt), and costs a hash instead of a decode.
Slices are cut at the first comma after a fixed size, so equal leading IDs give equal leading slices.

A prompt is also kept whole, found again by its first bytes: the same prompt again (the k attempts
of a task, a retry, a benchmark) costs one comparison of its JSON text, and a conversation's next
turn (the last prompt and more) a comparison plus its new IDs, where the slices would hash every
slice and decode the last partial one again.

A slice the cache misses is read by agl_sidecar._token_elements (C, built by the package's install)
when it is there: the JSON text straight to the encoded entries (2k IDs: 9 us against 68 us to decode
them to Python ints and encode those). It answers only the common case (IDs below 2**21, plain integers);
anything else, and every slice where the extension is not built, takes the pure-Python path.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from msgspec import Raw

from agl_sidecar.spans import otlp
from agl_sidecar.calls import wire
from agl_sidecar.spans.lru import BytesLRU

try:
    from agl_sidecar._token_elements import int_array_elements
except ImportError:  # not built (no compiler where it was installed): the pure-Python path
    int_array_elements = None

SLICE_TOKENS = 2048  # ~0.15 ms to decode and encode
SLICE_JSON_BYTES = 12 * 1024  # about 2k token IDs of JSON text
# Whole prompts are found by this many leading bytes of their JSON (shorter ones cost little anyway).
HEAD_BYTES = 256
# Prompts kept per head: the latest turns of conversations that start alike.
PROMPTS_PER_HEAD = 8
_SPACE = b" \t\r\n"


# A prompt kept whole: its JSON text without the closing bracket, and its encoding.
Prompt = tuple[bytes, otlp.IntArray]


class SliceCache:
    """Encoded int-array slices by their JSON text, and whole prompts by their head (a 1-tuple of it,
    apart from the slices); one LRU bounded by bytes (text + encoding)."""

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        self._lru: BytesLRU[Any, Any] = BytesLRU(max_bytes, _entry_size)
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

    def longest_prompt(self, data: bytes) -> Prompt | None:
        """The longest kept prompt whose IDs begin the JSON int array `data`."""
        best: Prompt | None = None
        for prompt in self._lru.get((data[:HEAD_BYTES],)) or ():
            body = prompt[0]
            end = len(body)
            if (best is None or end > len(best[0])) and data.startswith(body):
                # Its IDs end where `data` goes on to another ID, or ends too.
                if data[end : end + 1] == b"," or data[end:].lstrip(_SPACE) == b"]":
                    best = prompt
        return best

    def keep_prompt(self, data: bytes, encoded: otlp.IntArray) -> None:
        """Keep the prompt `data` (its JSON, verbatim) whole, the latest first under its head."""
        key = (data[:HEAD_BYTES],)
        body = data[: data.rindex(b"]")].rstrip(_SPACE)
        kept = self._lru.get(key) or ()
        self._lru.put(key, ((body, encoded), *kept[: PROMPTS_PER_HEAD - 1]))


def _entry_size(key: Any, value: Any) -> int:
    if type(key) is tuple:  # a head: its prompts
        return len(key[0]) + sum(len(body) + len(encoded.elements) for body, encoded in value)
    return len(key) + len(value.elements)


def encode_token_ids(
    value: list[int] | Raw, cache: SliceCache, prompt: bool = False
) -> Generator[None, None, otlp.IntArray | None]:
    """`value` (IDs, or the engine's JSON array) as an encoded int array, yielding between slices;
    None when the engine sent null. Raises msgspec.ValidationError for anything but an int array.
    `prompt`: a prompt's JSON, also kept whole (and found whole) in the cache."""
    parts: list[otlp.IntArray] = []
    if isinstance(value, list):
        if len(value) <= SLICE_TOKENS:
            return otlp.IntArray.of(value)
        for start in range(0, len(value), SLICE_TOKENS):
            parts.append(otlp.IntArray.of(value[start : start + SLICE_TOKENS]))
            yield
        return otlp.IntArray.concat(parts)
    if not prompt:
        return (yield from _encode_json(value, cache))
    data = bytes(value)
    if len(data) <= 2 * HEAD_BYTES or not data.startswith(b"["):
        return (yield from _encode_json(data, cache))
    kept = cache.longest_prompt(data)
    if kept is None:
        encoded = yield from _encode_json(data, cache)
    else:
        body, known = kept
        if data[len(body) : len(body) + 1] != b",":  # the same prompt again
            known.shared = True  # in several spans: compressed once for all (deflate.py)
            return known
        rest = yield from _encode_json(b"[" + data[len(body) + 1 :], cache)
        if rest is None:  # not an int array after all
            return None
        encoded = otlp.IntArray.concat([known, rest])
    if encoded is not None:
        cache.keep_prompt(data, encoded)
    return encoded


def _encode_json(value: Raw | bytes, cache: SliceCache) -> Generator[None, None, otlp.IntArray | None]:
    """The JSON int array `value`, slice by slice through the cache."""
    parts: list[otlp.IntArray] = []
    for text, full_size in wire.int_array_pieces(value, SLICE_JSON_BYTES):
        encoded = cache.get(text) if full_size else None
        if encoded is None:
            fast = int_array_elements(text) if int_array_elements is not None else None
            if fast is not None:
                encoded = otlp.IntArray(*fast)
            else:
                ids = wire.token_ids(text)
                if ids is None:
                    return None
                encoded = otlp.IntArray.of(ids)
            if full_size:
                cache.put(text, encoded)
            yield
        parts.append(encoded)
    return otlp.IntArray.concat(parts) if parts else otlp.IntArray(b"", 0)
