"""The sidecar's Prometheus metrics: a few counters and one latency histogram, written in the text
exposition format by prometheus_client.

A call counts in plain ints and a histogram of fixed buckets (a bisect): well under a microsecond,
where prometheus_client's labelled Counter and Histogram cost about 10 us a call. /metrics hands
the counts to prometheus_client as metric families (a custom collector, read once per scrape).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

PREFIX = "agl_sidecar_"
# Exporter values that go up and down (the rest only count up).
EXPORT_GAUGES = ("spans_pending", "spans_sending", "spans_in_spool", "spool_files")
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
GAUGE_HELP = {
    "in_flight": "Model calls being answered now.",
    "held": "Model calls held by a pause.",
    "paused": "1 while the sidecar is paused.",
    "policy_version": "The policy version new calls are recorded under.",
    "healthy_upstreams": "Engines that answer their health check.",
    "engine_connections_idle": "Idle keep-alive connections to http:// engines.",
}


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, observations at or below it) per bucket, +Inf last: the exposition's buckets."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            running += count
            out.append((floatToGoString(bound), running))
        out.append(("+Inf", self.count))
        return out


class _Families:
    """A collector of families built for one scrape."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> list[Metric]:
        return self.families


class Metrics:
    def __init__(self) -> None:
        # (api, status) -> count
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.latency: dict[str, Histogram] = defaultdict(Histogram)
        self.held_timeouts = 0
        self.client_disconnects = 0
        self.upstream_errors = 0

    def observe(self, api: str, status: int, seconds: float) -> None:
        self.requests[(api, status)] += 1
        self.latency[api].observe(seconds)

    def render(
        self, gauges: dict[str, float], exporter: dict[str, int], counters: dict[str, tuple[int, str]] | None = None
    ) -> str:
        """The text exposition. `counters`: more counters, name (without `_total`) -> (value, help text)."""
        return generate_latest(_Families(self.families(gauges, exporter, counters))).decode()

    def families(
        self, gauges: dict[str, float], exporter: dict[str, int], counters: dict[str, tuple[int, str]] | None = None
    ) -> list[Metric]:
        requests = CounterMetricFamily(
            f"{PREFIX}requests", "Model calls answered, by API and HTTP status.", labels=["api", "status"]
        )
        for (api, status), count in sorted(self.requests.items()):
            requests.add_metric([api, str(status)], count)
        latency = HistogramMetricFamily(
            f"{PREFIX}request_duration_seconds", "Model call latency as the harness saw it.", labels=["api"]
        )
        for api, histogram in sorted(self.latency.items()):
            latency.add_metric([api], histogram.cumulative(), histogram.total)
        out: list[Metric] = [requests, latency]
        for name, value, help_text in (
            ("held_timeouts", self.held_timeouts, "Calls refused after being held too long."),
            ("client_disconnects", self.client_disconnects, "Calls whose client went away."),
            ("upstream_errors", self.upstream_errors, "Calls the upstream failed or could not be reached."),
            *((name, value, help_text) for name, (value, help_text) in (counters or {}).items()),
        ):
            out.append(CounterMetricFamily(f"{PREFIX}{name}", help_text, value=value))
        for name, value in gauges.items():
            out.append(GaugeMetricFamily(f"{PREFIX}{name}", GAUGE_HELP.get(name, name), value=value))
        for name, value in exporter.items():
            help_text = f"The span exporter's {name.replace('_', ' ')}."
            kind = GaugeMetricFamily if name in EXPORT_GAUGES else CounterMetricFamily
            out.append(kind(f"{PREFIX}{name}", help_text, value=value))
        return out
