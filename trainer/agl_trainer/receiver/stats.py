"""Receiver counters: what arrived, what was stored, and why anything was refused."""

from __future__ import annotations

import threading

import msgspec
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric


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
    """The stats in the Prometheus text exposition format (prometheus_client writes it)."""
    return generate_latest(_Families(stats)).decode()


# name (without _total), help, the field of ReceiverStats; a dict field is counted by reason
COUNTERS = (
    ("agl_receiver_requests", "Export requests received.", "requests"),
    ("agl_receiver_accepted_requests", "Export requests stored and acknowledged.", "accepted_requests"),
    ("agl_receiver_refused_requests", "Export requests refused, by reason.", "bad_requests"),
    ("agl_receiver_spans", "Spans received.", "spans"),
    ("agl_receiver_spans_stored", "Spans newly stored.", "stored"),
    ("agl_receiver_spans_duplicate", "Spans received again and skipped.", "duplicates"),
    ("agl_receiver_spans_foreign", "Spans that are not agl's, ignored.", "foreign"),
    ("agl_receiver_contract_violations", "Spans breaking the span contract, by reason.", "violations"),
    ("agl_receiver_tokens", "Token IDs stored (prompt and completion).", "tokens"),
    ("agl_receiver_bytes", "Request body bytes received (as sent).", "bytes"),
    (
        "agl_receiver_log_records",
        "OTLP log records received (evaluation results among them are counted as spans too).",
        "log_records",
    ),
)


class _Families:
    """One snapshot's counters as prometheus_client metric families (a collector read once)."""

    def __init__(self, stats: ReceiverStats) -> None:
        self.stats = stats

    def collect(self) -> list[Metric]:
        families: list[Metric] = []
        for name, help_text, field in COUNTERS:
            value = getattr(self.stats, field)
            if isinstance(value, dict):
                family = CounterMetricFamily(name, help_text, labels=["reason"])
                for reason, count in sorted(value.items()):
                    family.add_metric([reason], count)
            else:
                family = CounterMetricFamily(name, help_text, value=value)
            families.append(family)
        return families
