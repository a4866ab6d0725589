"""One bad span never costs another (issue 14, defect 1, export side).

The exporter runs for real (its background task, aiohttp, the spool on disk) against a receiver
that decodes with opentelemetry-proto and refuses every request holding a bad span, as a receiver
with one transaction per request does."""

from __future__ import annotations

import asyncio
import gzip
import sqlite3
from pathlib import Path

import httpx

from agl import semconv
from agl_sidecar.spans import otlp
from agl_sidecar.config import build
from agl_sidecar.spans.exporter import SpanExporter
from agl_sidecar.metrics import Metrics
from agl_sidecar.spans.otlp import RequestFramer
from agl_sidecar.server import BackgroundSidecar
from agl_sidecar.spans.spool import SPOOL_SUFFIX
from tests.support.otlp_sink import OTLPSink, ReceivedSpan, received_span
from tests.support.waiting import wait_until, wait_until_async

FRAMER = RequestFramer({"service.name": "test"}, "agl", "0")


def make_span(rollout: str, **ints: int) -> bytes:
    attrs = [(semconv.ROLLOUT_ID, rollout), *((f"agl.{k}", v) for k, v in ints.items())]
    return otlp.span(trace_id=b"\x01" * 16, span_id=rollout.encode().ljust(8, b"-")[-8:], parent_span_id=None,
                     name="chat", kind=otlp.SPAN_KIND_CLIENT, start_ns=1, end_ns=2, attrs=attrs)


def poison(span: ReceivedSpan) -> bool:
    return str(span.rollout_id).startswith("poison")


def exporter(endpoint: str, spool: Path) -> SpanExporter:
    return SpanExporter(endpoint, FRAMER, spool, interval_s=0.02, max_backoff_s=0.2)


def received(sink: OTLPSink) -> list[str]:
    return sorted(str(s.rollout_id) for s in sink.spans)


def dead_letters(spool: Path) -> list[str]:
    """The rollout ids of the spans set aside under `spool`."""
    ids = []
    for path in sorted(spool.rglob("dead-letter/*" + SPOOL_SUFFIX)):
        for span_bytes in otlp.split_request(gzip.decompress(path.read_bytes())):
            from opentelemetry.proto.trace.v1.trace_pb2 import Span

            span = Span()
            span.ParseFromString(span_bytes)
            ids.append(str(received_span(span, {}).rollout_id))
    return sorted(ids)


def goods(count: int, prefix: str = "r") -> list[str]:
    return sorted(f"{prefix}{i:03d}" for i in range(count))


def test_a_refused_batch_is_split_and_only_the_bad_span_is_set_aside(tmp_path):
    async def run() -> SpanExporter:
        e = exporter(sink.endpoint, tmp_path)
        await e.start()
        for i in range(50):
            e.submit(make_span(f"r{i:03d}"))
            if i == 25:
                e.submit(make_span("poison"))
        assert await e.deliver(15)
        await e.close()
        return e

    with OTLPSink(refuse=poison, refuse_status=400) as sink:
        e = asyncio.run(run())
    assert received(sink) == goods(50)  # the 50 other spans of the refused batch all arrive
    assert dead_letters(tmp_path) == ["poison"]
    assert e.counters.spans_dead_lettered == 1 and e.counters.spans_failed == 0
    assert e.counters.spans_exported == 50
    why = list(tmp_path.rglob("dead-letter/*.why.txt"))
    assert why and "HTTP 400" in why[0].read_text()
    text = Metrics().render({}, {k: v for k, v in vars(e.counters).items() if k != "extra"})
    assert "agl_sidecar_spans_dead_lettered_total 1" in text


def test_a_spool_file_refused_for_good_is_set_aside_and_later_files_replay_after_a_restart(tmp_path):
    async def first_run() -> None:  # the endpoint is down: everything is spooled
        e = exporter(sink.endpoint, tmp_path)
        await e.start()
        for i in range(10):
            e.submit(make_span(f"a{i:03d}"))
        e.submit(make_span("poison"))
        await e.flush(10)
        for i in range(10):
            e.submit(make_span(f"b{i:03d}"))
        await e.flush(10)
        await e.close()

    async def second_run() -> SpanExporter:
        e = exporter(sink.endpoint, tmp_path)
        await e.start()
        assert await e.deliver(15)
        e.submit(make_span("c000"))  # live export works afterwards
        assert await e.deliver(15)
        await e.close()
        return e

    with OTLPSink(refuse=poison, refuse_status=400) as sink:
        sink.fail_with = 503
        asyncio.run(first_run())
        assert len(list(tmp_path.rglob("*" + SPOOL_SUFFIX))) >= 2 and not sink.spans
        sink.fail_with = None  # back, but it refuses the poisoned file for good
        e = asyncio.run(second_run())
    assert received(sink) == sorted(goods(10, "a") + goods(10, "b") + ["c000"])
    assert dead_letters(tmp_path) == ["poison"]
    assert e.counters.spans_dead_lettered == 1 and e.counters.spool_files == 0


def test_a_file_answered_5xx_forever_does_not_block_the_spool(tmp_path):
    """The issue's scenario: the receiver answers 503 to one batch forever (it cannot store it) and
    the exporter used to replay oldest first and stop there, so nothing it exported arrived again."""

    async def run() -> SpanExporter:
        e = exporter(sink.endpoint, tmp_path)
        await e.start()
        e.submit(make_span("poison"))
        for i in range(5):
            e.submit(make_span(f"a{i:03d}"))
        await e.flush(10)  # that batch fails with 503 and is spooled
        sent = 0

        def traffic_until_the_spool_moves_on() -> bool:
            nonlocal sent
            if e.counters.spans_dead_lettered and e.delivered:
                return True
            e.submit(make_span(f"b{sent:03d}"))  # traffic goes on
            sent += 1
            return False

        await wait_until_async(traffic_until_the_spool_moves_on, "the poison batch dead-lettered", timeout=20)
        assert await e.deliver(10)
        await e.close()
        e.counters.extra["sent"] = sent
        return e

    with OTLPSink(refuse=poison, refuse_status=503) as sink:
        e = asyncio.run(run())
    assert received(sink) == sorted(goods(5, "a") + goods(e.counters.extra["sent"], "b"))
    assert dead_letters(tmp_path) == ["poison"]
    assert e.counters.spans_failed == 0


def test_partial_success_is_counted_and_not_resent(tmp_path):
    async def run() -> SpanExporter:
        e = exporter(sink.endpoint, tmp_path)
        await e.start()
        for i in range(9):
            e.submit(make_span(f"r{i:03d}"))
        e.submit(make_span("poison"))
        assert await e.deliver(10)
        await e.close()
        return e

    with OTLPSink(refuse=poison, partial=True) as sink:
        e = asyncio.run(run())
        assert sink.requests == 1
    assert received(sink) == goods(9)
    assert e.counters.spans_rejected == 1 and e.counters.spans_exported == 9
    assert dead_letters(tmp_path) == []


def test_an_int_out_of_int64_range_is_never_encoded(tmp_path):
    async def run() -> SpanExporter:
        e = exporter(sink.endpoint, tmp_path)
        await e.start()
        e.submit(make_span("big", attempt=99999999999999999999, seq=3))
        e.submit(make_span("small", attempt=-(2**63), seq=2**63 - 1))
        e.submit(make_span("after"))
        assert await e.deliver(10)
        await e.close()
        return e

    with OTLPSink() as sink:  # a request protobuf cannot decode gets 400
        asyncio.run(run())
    by_rollout = {s.rollout_id: s.attributes for s in sink.spans}
    assert sorted(by_rollout) == ["after", "big", "small"]
    assert "agl.attempt" not in by_rollout["big"] and by_rollout["big"]["agl.seq"] == 3
    assert by_rollout["big"][otlp.OUT_OF_RANGE_KEY] == ["agl.attempt=99999999999999999999"]
    assert by_rollout["small"]["agl.attempt"] == -(2**63) and by_rollout["small"]["agl.seq"] == 2**63 - 1


def test_a_harness_call_with_a_huge_attempt_costs_no_later_span_even_after_a_restart(fake, tmp_path):
    """Through the sidecar into the real agl receiver and store: whatever the harness gets for
    attempt 99999999999999999999 (a 400 naming it, or a recorded span), the calls after it, and
    after a sidecar restart, are all stored."""
    from agl_trainer.receiver import Receiver, ReceiverConfig

    store = tmp_path / "rollouts.db"
    settings = {"upstream": [fake.base_url], "listen": "127.0.0.1:0", "spool_dir": str(tmp_path / "spool"),
                "export_interval_s": 0.05}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}]}

    def stored_calls() -> int:
        with sqlite3.connect(store) as db:
            return db.execute("select count(*) from calls where rollout_id like 'good%'").fetchone()[0]

    with Receiver(store, ReceiverConfig(port=0, grpc_port=0)) as receiver:
        settings["otlp_endpoint"] = receiver.url
        for run in range(2):  # the second run is the restart
            with BackgroundSidecar(build(settings)) as sidecar:
                bad = httpx.post(f"{sidecar.url}/rollouts/bad/attempts/99999999999999999999/v1/chat/completions",
                                 json=body)
                assert bad.status_code < 500, bad.text
                for i in range(10):
                    r = httpx.post(f"{sidecar.url}/rollouts/good{run}-{i}/v1/chat/completions", json=body)
                    assert r.status_code == 200
                wait_until(lambda: stored_calls() >= 10 * (run + 1), f"{10 * (run + 1)} calls stored", timeout=20)
                assert stored_calls() == 10 * (run + 1)
                assert sidecar.sidecar.exporter.counters.spans_failed == 0
