"""Offline import of OTLP JSON lines, as an OpenTelemetry Collector's file exporter writes them
(one ExportTraceServiceRequest per line; `.gz` files are read compressed)."""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from agl_trainer.receiver.payload import JSON, decode_body
from agl_trainer.receiver.wire import DecodeError
from agl_trainer.store import RolloutStore
from agl_trainer.store.records import Record

LINES_PER_TRANSACTION = 200


class ImportResult(msgspec.Struct):
    lines: int = 0
    spans: int = 0
    stored: int = 0
    duplicates: int = 0
    foreign: int = 0
    violations: dict[str, int] = {}
    bad_lines: list[tuple[int, str]] = []  # (line number, reason): not imported


def _lines(path: Path) -> Iterator[bytes]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        yield from handle


def import_jsonl(
    store: RolloutStore, path: str | Path, progress: Callable[[int], None] | None = None
) -> ImportResult:
    """Import every line of `path`; a bad line is reported with its number, the rest still imported."""
    path = Path(path)
    result = ImportResult(violations={}, bad_lines=[])
    pending: list[Record] = []

    def flush() -> None:
        written = store.write(pending)
        result.stored += written.stored
        result.duplicates += written.duplicates
        for reason, count in written.violations.items():
            result.violations[reason] = result.violations.get(reason, 0) + count
        pending.clear()

    for number, line in enumerate(_lines(path), start=1):
        result.lines += 1
        if progress is not None:
            progress(len(line))
        if not line.strip():
            continue
        try:
            batch = decode_body(line, JSON)
        except DecodeError as error:
            result.bad_lines.append((number, str(error)))
            continue
        result.spans += batch.spans
        result.foreign += batch.foreign
        pending.extend(batch.records)
        if result.lines % LINES_PER_TRANSACTION == 0:
            flush()
    flush()
    return result
