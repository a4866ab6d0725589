"""Receiver counters: what arrived, what was stored, and why anything was refused."""

from __future__ import annotations

import threading

import msgspec


class ReceiverStats(msgspec.Struct):
    requests: int = 0
    accepted_requests: int = 0
    bad_requests: dict[str, int] = {}  # refused requests by reason (HTTP status or gRPC code + kind)
    spans: int = 0
    stored: int = 0
    duplicates: int = 0
    foreign: int = 0  # spans that are not agl's, ignored
    violations: dict[str, int] = {}  # spans that break the contract, by reason (kept, not trained)
    tokens: int = 0
    bytes: int = 0
    log_records: int = 0  # OTLP log records received; only evaluation results are read (as spans)


class StatsCounter:
    """Thread-safe accumulation of ReceiverStats (HTTP handlers and gRPC threads both count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = ReceiverStats(bad_requests={}, violations={})

    def request(self, size: int) -> None:
        with self._lock:
            self._stats.requests += 1
            self._stats.bytes += size

    def refused(self, reason: str) -> None:
        with self._lock:
            self._stats.bad_requests[reason] = self._stats.bad_requests.get(reason, 0) + 1

    def accepted(
        self,
        spans: int,
        foreign: int,
        stored: int,
        duplicates: int,
        tokens: int,
        violations: dict[str, int],
        log_records: int = 0,
    ) -> None:
        with self._lock:
            s = self._stats
            s.accepted_requests += 1
            s.log_records += log_records
            s.spans += spans
            s.foreign += foreign
            s.stored += stored
            s.duplicates += duplicates
            s.tokens += tokens
            for reason, count in violations.items():
                s.violations[reason] = s.violations.get(reason, 0) + count

    def snapshot(self) -> ReceiverStats:
        with self._lock:
            return msgspec.structs.replace(
                self._stats,
                bad_requests=dict(self._stats.bad_requests),
                violations=dict(self._stats.violations),
            )


def prometheus(stats: ReceiverStats) -> str:
    """The stats in the Prometheus text exposition format."""
    lines = []

    def counter(name: str, help_text: str, value: int, labels: str = "") -> None:
        if not any(line.startswith(f"# TYPE {name} ") for line in lines):
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} counter")
        lines.append(f"{name}{labels} {value}")

    def by_reason(name: str, help_text: str, counts: dict[str, int]) -> None:
        for reason, count in sorted(counts.items()):
            counter(name, help_text, count, f'{{reason="{reason}"}}')

    counter("agl_receiver_requests_total", "Export requests received.", stats.requests)
    counter(
        "agl_receiver_accepted_requests_total",
        "Export requests stored and acknowledged.",
        stats.accepted_requests,
    )
    by_reason("agl_receiver_refused_requests_total", "Export requests refused, by reason.", stats.bad_requests)
    counter("agl_receiver_spans_total", "Spans received.", stats.spans)
    counter("agl_receiver_spans_stored_total", "Spans newly stored.", stats.stored)
    counter("agl_receiver_spans_duplicate_total", "Spans received again and skipped.", stats.duplicates)
    counter("agl_receiver_spans_foreign_total", "Spans that are not agl's, ignored.", stats.foreign)
    by_reason(
        "agl_receiver_contract_violations_total", "Spans breaking the span contract, by reason.", stats.violations
    )
    counter("agl_receiver_tokens_total", "Token IDs stored (prompt and completion).", stats.tokens)
    counter("agl_receiver_bytes_total", "Request body bytes received (as sent).", stats.bytes)
    counter(
        "agl_receiver_log_records_total",
        "OTLP log records received (evaluation results among them are counted as spans too).",
        stats.log_records,
    )
    return "\n".join(lines) + "\n"
