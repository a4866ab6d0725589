"""Export requests gzipped from pieces (spans/deflate.py): a shared array's deflate stream kept and
copied into each request, the CRC-32 combined; the result inflates to the very request bytes."""

from __future__ import annotations

import gzip
import random
import zlib

import msgspec

from agl_sidecar.calls.attribution import Identity
from agl_sidecar.calls.record import CallRecord
from agl_sidecar.spans import deflate, otlp
from agl_sidecar.spans.recorder import SpanRecorder
from tests.support.otlp_sink import RecorderSpans

FRAMER = otlp.RequestFramer({"service.name": "t"}, "agl", "0")


def _span(*arrays: otlp.IntArray, name: str = "chat tiny") -> bytes:
    attrs = [("a.before", "x" * random.randrange(0, 300))]
    attrs += [(f"a.ids.{i}", array) for i, array in enumerate(arrays)]
    attrs.append(("a.after", random.randrange(0, 1 << 40)))
    return otlp.span(trace_id=b"t" * 16, span_id=b"s" * 8, parent_span_id=None, name=name, kind=3,
                     start_ns=1, end_ns=2, attrs=attrs)


def _shared(tokens: int) -> otlp.IntArray:
    array = otlp.IntArray.of([random.randrange(0, 150_000) for _ in range(tokens)])
    array.shared = True
    return array


def test_crc32_combine_matches_zlib():
    for _ in range(50):
        a, b = random.randbytes(random.randrange(0, 3000)), random.randbytes(random.randrange(0, 3000))
        operator = deflate.shift_operator(len(b))
        assert deflate.crc32_combine(zlib.crc32(a), zlib.crc32(b), operator) == zlib.crc32(a + b)


def test_a_request_with_shared_arrays_inflates_to_the_same_bytes():
    streams = deflate.KeptStreams()
    prompt, other = _shared(30_000), _shared(2_000)
    small = _shared(10)  # below SHARED_MIN_BYTES: compressed inline
    unshared = otlp.IntArray.of(list(range(5_000)))
    spans = [_span(prompt), _span(unshared), _span(prompt, other), _span(small), _span(other, prompt), _span()]
    assert [type(s) is otlp.SharedSpan for s in spans] == [True, False, True, False, True, False]
    for level in (1, 6):
        for batch in (spans, spans[:1], spans[1:2], list(reversed(spans)), spans * 3):
            assert gzip.decompress(deflate.gzip_spans(FRAMER, batch, level, streams)) == FRAMER.request(batch)
    # Kept once, reused: a request of the same span again costs the bytes around it.
    body = deflate.gzip_spans(FRAMER, [spans[0]] * 8, 1, streams)
    assert len(body) < 8 * len(streams.get(prompt, 1).deflated) + 4096


def test_kept_streams_stay_within_their_bytes():
    streams = deflate.KeptStreams(max_bytes=1_000_000)
    for _ in range(20):
        span = _span(_shared(30_000))
        assert gzip.decompress(deflate.gzip_spans(FRAMER, [span], 1, streams)) == FRAMER.request([span])
    assert 0 < streams._lru.bytes <= 1_000_000


def test_a_prompt_seen_again_goes_out_shared_and_whole():
    exporter = RecorderSpans()
    recorder = SpanRecorder(exporter)  # no running loop: spans are built at once
    prompt = msgspec.json.encode([random.randrange(0, 150_000) for _ in range(20_000)])
    for _ in range(3):
        call = CallRecord(api="openai.chat", operation="chat", identity=Identity(), trace_parent=None, start_ns=1,
                          model="tiny")
        call.prompt_ids = msgspec.Raw(prompt)
        call.choice(0).token_ids = msgspec.Raw(b"[1,2,3]")
        recorder.finish(call)
    first, second, third = exporter.spans
    assert type(first) is bytes and type(second) is otlp.SharedSpan and type(third) is otlp.SharedSpan
    assert second.shared[0][1] is third.shared[0][1]
    streams = deflate.KeptStreams()
    batch = exporter.spans
    assert gzip.decompress(deflate.gzip_spans(FRAMER, batch, 1, streams)) == FRAMER.request(batch)
