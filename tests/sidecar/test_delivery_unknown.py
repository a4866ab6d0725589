"""Durable mode: a call's span is on disk before its last bytes go, so a sidecar killed between the
two leaves the span of a call whose harness saw an error (75 in one loaded SIGKILL run, issue 42).
Each call's last bytes are followed in the log by a delivery marker; a call span recovered without
one says `agl.call.delivery = unknown`, the receiver stores it as ending in `delivery_unknown`, and
assembly trains it only when a later call of its rollout builds on its answer."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agl import semconv
from agl_sidecar.spans import otlp
from agl_sidecar.spans.durable import IDENTITY_BYTES, SpanLog
from agl_sidecar.spans.exporter import SpanExporter
from agl_sidecar.spans.spool import Spool
from agl_trainer.assembly import AssemblyConfig, assemble_rollout
from agl_trainer.store import RolloutStore

from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import call_span, reward_span, rollout_span, with_attributes
from tests.support.otlp_sink import OTLPSink

FRAMER = otlp.RequestFramer({"service.name": "agl-sidecar"}, "agl", "0")


def _span(name: str, kind: int, rollout: str, seq: int | None = None) -> bytes:
    attrs: list = [(semconv.ROLLOUT_ID, rollout), (semconv.CALL_END_REASON, semconv.END_COMPLETED)]
    if seq is not None:
        attrs.append((semconv.CALL_SEQ, seq))
    return otlp.span(trace_id=bytes(range(16)), span_id=bytes([seq or 99] * 8), parent_span_id=None, name=name,
                     kind=kind, start_ns=1, end_ns=2, attrs=attrs)  # fmt: skip


def test_a_recovered_call_span_without_its_delivery_marker_says_delivery_unknown(tmp_path: Path) -> None:
    answered, cut, reward = _span("chat tiny", 3, "r", 1), _span("chat tiny", 3, "r", 2), _span("agl.reward", 1, "r")
    with OTLPSink() as sink:

        async def killed_sidecar() -> None:
            spool = Spool(tmp_path, sink.endpoint, "http/protobuf")
            spool.open()
            log = SpanLog(spool)
            for span in (answered, cut, reward):
                log.append(span)
            await log.sync()  # all three on disk: the calls' last bytes may go now
            log.mark_delivered(answered[:IDENTITY_BYTES])  # the first call's went; the kill came before the second's
            while log._marking is not None:
                await asyncio.sleep(0.01)
            spool.close()  # the process is gone: its slot's lock is free, its log left behind

        async def next_sidecar() -> None:
            exporter = SpanExporter(sink.endpoint, FRAMER, tmp_path, durable=True, interval_s=0.05, compress=False)
            await exporter.start()  # recovers the log, replays it
            assert await exporter.deliver(30)
            await exporter.close()

        asyncio.run(killed_sidecar())
        asyncio.run(next_sidecar())
        spans = sink.wait_for(lambda spans: len(spans) >= 3)
    delivery = {(s.name, s.attributes.get(semconv.CALL_SEQ)): s.attributes.get(semconv.CALL_DELIVERY) for s in spans}
    assert delivery == {("chat tiny", 1): None, ("chat tiny", 2): semconv.DELIVERY_UNKNOWN, ("agl.reward", None): None}


def _unknown(span):  # noqa: ANN001, ANN202
    return with_attributes(span, agl__call__delivery=semconv.DELIVERY_UNKNOWN)


def test_a_call_of_unknown_delivery_trains_only_when_a_later_call_builds_on_it(tmp_path: Path) -> None:
    p = [1, 2, 3]
    spans = [
        call_span("built-on", 0, p, [4, 5]),
        _unknown(call_span("built-on", 1, [*p, 4, 5, 6], [7, 8])),  # the next call extends its answer
        call_span("built-on", 2, [*p, 4, 5, 6, 7, 8, 9], [10]),
        _unknown(call_span("retried", 0, p, [4, 5])),  # the harness saw an error: it sent the turn again
        call_span("retried", 1, p, [6, 7]),
        _unknown(call_span("last", 0, p, [4])),  # answered as the sidecar died: nothing after it
        reward_span("built-on", 1.0), reward_span("retried", 1.0), reward_span("last", 1.0),
        rollout_span("built-on"), rollout_span("retried"), rollout_span("last"),
    ]
    with RolloutStore(tmp_path / "store.db", grace_s=0.0) as store:
        ingest(store, spans)
        store.refresh_completion()
        stored = {c.call_seq: c.end_reason for c in store.load("retried").calls}
        assert stored == {0: semconv.END_DELIVERY_UNKNOWN, 1: semconv.END_COMPLETED}
        trained, problems = {}, {}
        for rollout in ("built-on", "retried", "last"):
            assembly = assemble_rollout(store.load(rollout), AssemblyConfig())
            samples = assembly.result.samples if assembly.result is not None else []
            trained[rollout] = sorted(seq for sample in samples for seq in sample.call_seqs)
            problems[rollout] = assembly.problems
    assert trained["built-on"] == [0, 1, 2]  # the harness evidently got call 1's answer
    assert trained["retried"] == [1] and problems["retried"] == {"delivery_unknown_not_built_on": 1}
    assert trained["last"] == [] and problems["last"] == {"delivery_unknown_not_built_on": 1}
