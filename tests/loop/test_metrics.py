"""Metrics: JSONL, Prometheus text, TensorBoard event files and the reward/entropy PNG."""

from __future__ import annotations

import json
from pathlib import Path

from agl_trainer.metrics import MetricsWriter, plot_run, read_jsonl
from agl_trainer.metrics.writer import prometheus_name
from prometheus_client.parser import text_string_to_metric_families


def test_metrics_in_every_format(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path)
    for step in range(1, 4):
        writer.write(step, {"reward/mean": 0.2 * step, "actor/entropy": 2.0 / step, "note": "skipped", "flag": True})
    writer.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["reward/mean"] == 0.2 * 3 and "note" not in rows[0] and rows[0]["flag"] == 1.0
    prom = (tmp_path / "metrics.prom").read_text()
    families = {family.name: family for family in text_string_to_metric_families(prom)}  # the exposition, parsed
    assert families["agl_train_step"].type == "gauge" and families["agl_train_step"].samples[0].value == 3.0
    assert f"{prometheus_name('reward/mean')} {0.2 * 3!r}" in prom and "# TYPE agl_train_reward_mean gauge" in prom
    assert families["agl_train_actor_entropy"].samples[0].value == 2.0 / 3  # every metric's latest value
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [round(e.value, 5) for e in events.Scalars("reward/mean")] == [0.2, 0.4, 0.6]
    assert [e.step for e in events.Scalars("actor/entropy")] == [1, 2, 3]
    png = plot_run(tmp_path)
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_plot_without_training(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "time/idle_s": 1.0}) + "\n")
    assert plot_run(tmp_path) is None
