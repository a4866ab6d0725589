"""The durable-mode span log: group commit, deletion once settled, recovery of a torn tail."""

from __future__ import annotations

import asyncio
import os

from agl_sidecar.spans.durable import SpanLog, read_segment
from agl_sidecar.spans.spool import WAL_SUFFIX, Spool


def test_concurrent_calls_share_fsyncs_and_settled_segments_are_deleted(tmp_path, monkeypatch):
    syncs = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (syncs.append(fd), real(fd)))
    spool = Spool(tmp_path, "http://127.0.0.1:4318", "http/protobuf")
    spool.open()

    async def run() -> None:
        log = SpanLog(spool)

        async def one_call(i: int) -> None:
            log.append(f"span {i}".encode())
            await log.sync()

        await asyncio.gather(*(one_call(i) for i in range(64)))
        segments = spool.files(WAL_SUFFIX)
        assert [list(read_segment(p)) for p in segments] == [[f"span {i}".encode() for i in range(64)]]
        await log.rotate()
        log.settle(63)
        assert spool.files(WAL_SUFFIX) == segments  # one span of the segment is not settled yet
        log.settle(1)
        assert spool.files(WAL_SUFFIX) == []
        await log.close()

    asyncio.run(run())
    assert 1 <= len(syncs) < 64 / 4  # group commit: one fsync for many calls


def test_a_torn_tail_ends_recovery_and_keeps_what_came_before(tmp_path):
    spool = Spool(tmp_path, "http://127.0.0.1:4318", "http/protobuf")
    spool.open()

    async def run() -> None:
        log = SpanLog(spool)
        for i in range(3):
            log.append(b"x" * 300 + bytes([i]))
        await log.sync()
        await log.close()

    asyncio.run(run())
    (segment,) = spool.files(WAL_SUFFIX)
    data = segment.read_bytes()
    segment.write_bytes(data[:-100])  # killed mid-write: the last span is cut short
    assert list(read_segment(segment)) == [b"x" * 300 + bytes([i]) for i in range(2)]


def test_spool_gauges_are_gauges_and_dead_letters_a_counter():
    from agl_sidecar.spans.exporter import ExportCounters
    from agl_sidecar.metrics import Metrics

    counters = ExportCounters(spans_in_spool=3, spans_dead_lettered=2)
    text = Metrics().render({}, {k: v for k, v in vars(counters).items() if k != "extra"})
    assert "# TYPE agl_sidecar_spans_in_spool gauge\nagl_sidecar_spans_in_spool 3" in text
    assert "# TYPE agl_sidecar_spans_dead_lettered_total counter\nagl_sidecar_spans_dead_lettered_total 2" in text
