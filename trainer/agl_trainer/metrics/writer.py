"""`MetricsWriter`: JSONL, TensorBoard and Prometheus text, from one dict per step."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

from prometheus_client.exposition import write_to_textfile
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

PROMETHEUS_PREFIX = "agl_train_"


class MetricsWriter:
    def __init__(self, output_dir: Path, *, tensorboard: bool = True, trackers: Any = None) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.output_dir / "metrics.jsonl"
        self.prometheus_path = self.output_dir / "metrics.prom"
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        self._tensorboard: Any = None
        self._latest: dict[str, float] = {}  # every metric's latest value, for metrics.prom
        self.trackers = trackers  # metrics/trackers.py: W&B, MLflow (configured ones), or None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.output_dir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        clean = {name: float(value) for name, value in metrics.items() if _is_number(value)}
        # The step is the integer given: a metrics dict that carries its own "step" (a float, as the
        # loop's history rows do) does not override it; readers key rows by it.
        row = {"step": step, "time": time.time()}
        row.update((name, value) for name, value in clean.items() if name not in row)
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tensorboard is not None:
            for name, value in clean.items():
                if math.isfinite(value):
                    self._tensorboard.add_scalar(name, value, step)
            self._tensorboard.flush()
        if self.trackers:
            self.trackers.log(step, clean)  # a failing tracker warns once and is dropped, never raises
        # A validation row holds only val/*: metrics.prom keeps showing the training metrics too.
        self._latest.update(clean)
        self._write_prometheus(step, self._latest)

    def _write_prometheus(self, step: int, metrics: dict[str, float]) -> None:
        # prometheus_client writes the text format, to a temporary file renamed over the old one:
        # readers never see half a file
        write_to_textfile(str(self.prometheus_path), _Gauges(step, metrics))

    def close(self) -> None:
        self._jsonl.close()
        if self.trackers is not None:
            self.trackers.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def prometheus_name(name: str) -> str:
    """`reward/mean` -> `agl_train_reward_mean` (Prometheus allows [a-zA-Z0-9_:])."""
    return PROMETHEUS_PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", name).strip("_")


class _Gauges:
    """The step and every metric's latest value as gauges (a collector read once per write), each
    metric's own name as its help text."""

    def __init__(self, step: int, metrics: dict[str, float]) -> None:
        self.step = step
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        step = GaugeMetricFamily(f"{PROMETHEUS_PREFIX}step", "training steps done", value=self.step)
        families: list[Metric] = [step]
        for name, value in sorted(self.metrics.items()):
            families.append(GaugeMetricFamily(prometheus_name(name), name, value=value))
        return families


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if not Path(path).exists():
        return rows
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                rows.append(json.loads(line))
    return rows
