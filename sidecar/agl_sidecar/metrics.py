"""Prometheus text exposition, without a client library: a few counters and one histogram."""

from __future__ import annotations

import bisect
from collections import defaultdict

# Exporter values that go up and down (the rest only count up).
EXPORT_GAUGES = ("spans_pending", "spans_sending", "spans_in_spool", "spool_files")
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


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

    def lines(self, name: str, labels: str = "") -> list[str]:
        out = []
        cumulative = 0
        sep = "," if labels else ""
        for bound, count in zip(self.buckets, self.counts, strict=False):
            cumulative += count
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {cumulative}')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        brace = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{brace} {self.total}")
        out.append(f"{name}_count{brace} {self.count}")
        return out


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
        """`counters`: more counters, name (without `_total`) -> (value, help text)."""
        lines = [
            "# HELP agl_sidecar_requests_total Model calls answered, by API and HTTP status.",
            "# TYPE agl_sidecar_requests_total counter",
        ]
        for (api, status), count in sorted(self.requests.items()):
            lines.append(f'agl_sidecar_requests_total{{api="{api}",status="{status}"}} {count}')
        lines += [
            "# HELP agl_sidecar_request_duration_seconds Model call latency as the harness saw it.",
            "# TYPE agl_sidecar_request_duration_seconds histogram",
        ]
        for api, histogram in sorted(self.latency.items()):
            lines += histogram.lines("agl_sidecar_request_duration_seconds", f'api="{api}"')
        for name, value, help_text in (
            ("held_timeouts_total", self.held_timeouts, "Calls refused after being held too long."),
            ("client_disconnects_total", self.client_disconnects, "Calls whose client went away."),
            ("upstream_errors_total", self.upstream_errors, "Calls the upstream failed or could not be reached."),
            *((f"{name}_total", value, help_text) for name, (value, help_text) in (counters or {}).items()),
        ):
            lines += [f"# HELP agl_sidecar_{name} {help_text}", f"# TYPE agl_sidecar_{name} counter"]
            lines.append(f"agl_sidecar_{name} {value}")
        for name, value in gauges.items():
            lines += [f"# TYPE agl_sidecar_{name} gauge", f"agl_sidecar_{name} {value}"]
        for name, value in exporter.items():
            kind = "gauge" if name in EXPORT_GAUGES else "counter"
            metric = f"agl_sidecar_{name}" + ("_total" if kind == "counter" else "")
            lines += [f"# TYPE {metric} {kind}", f"{metric} {value}"]
        return "\n".join(lines) + "\n"
