"""A failure inside an export cycle that nobody planned for (a header aiohttp refuses to send, a bug
in encoding) never loses the batch it hit: the batch is spooled (or counted as failed), the export
request gauge returns to 0, and once the cause is gone every span is delivered."""

from __future__ import annotations

from typing import Any

import httpx

from agl import semconv

from tests.support.otlp_sink import OTLPSink
from tests.support.waiting import wait_until

MESSAGES = [{"role": "user", "content": "go"}]


def _calls(url: str, count: int) -> None:
    with httpx.Client() as client:
        for i in range(count):
            r = client.post(f"{url}/rollouts/r{i}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
            assert r.status_code == 200


def _accounted(counters: Any) -> int:
    """Spans whose fate is known: acknowledged, waiting on disk, set aside or counted lost."""
    return counters.spans_exported + counters.spans_in_spool + counters.spans_dead_lettered + counters.spans_failed


def test_a_cycle_that_raises_spools_its_batch_and_delivers_it_later(fake, make_sidecar, tmp_path):
    with OTLPSink() as sink:
        sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=sink.endpoint, otlp_compression="none")
        exporter = sidecar.sidecar.exporter
        encode = exporter._encode
        raised: list[int] = []

        async def broken_once(batch: Any, gzipped: bool) -> bytes:
            if not raised:
                raised.append(len(batch))
                raise RuntimeError("injected: a fault inside the export cycle")
            return await encode(batch, gzipped)

        exporter._encode = broken_once
        _calls(sidecar.url, 40)
        spans = sink.wait_for(lambda spans: len({s.attributes[semconv.CALL_SEQ] for s in spans}) >= 40, timeout=30)
        assert raised  # the fault did hit a batch
        assert len({s.attributes[semconv.ROLLOUT_ID] for s in spans}) == 40
        counters = exporter.counters
        wait_until(lambda: counters.spans_sending == 0 and counters.spool_files == 0, "the spool replayed")
        assert counters.spans_failed == 0 and counters.spans_spooled >= raised[0]


def test_a_header_aiohttp_cannot_send_keeps_every_span_counted(fake, make_sidecar, tmp_path):
    # What a line break in an otlp_headers value did before it was refused at start: every cycle died
    # with its batch in flight, the next overwrote it (20 of 40 lost, spans_failed 0, spans_sending 20).
    with OTLPSink() as sink:
        sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=sink.endpoint, otlp_compression="none")
        exporter = sidecar.sidecar.exporter
        exporter.headers["x-tenant"] = "a\r\nb"  # set past the config check, as a library caller could
        _calls(sidecar.url, 40)
        counters = exporter.counters
        wait_until(lambda: counters.spans_submitted == 40 and counters.spans_pending == 0
                   and counters.spans_sending == 0 and _accounted(counters) == 40, "all 40 spans accounted for")
        assert counters.spans_in_spool == 40 and sink.spans == []
        del exporter.headers["x-tenant"]  # the cause fixed: the spool is delivered
        spans = sink.wait_for(lambda spans: len(spans) >= 40, timeout=60)
        assert len({s.attributes[semconv.ROLLOUT_ID] for s in spans}) == 40
        wait_until(lambda: counters.spool_files == 0, "the spool replayed")
        assert counters.spans_failed == 0 and counters.spans_sending == 0
