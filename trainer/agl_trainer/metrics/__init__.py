"""Training metrics, per step, in every format people read them in.

`MetricsWriter(output_dir)` fans one `write(step, metrics)` out to:
- metrics.jsonl: one JSON object a line ({"step": 3, "time": ..., "reward/mean": 0.61, ...});
- tensorboard/: scalars for TensorBoard (`tensorboard --logdir OUTPUT_DIR/tensorboard`);
- metrics.prom: Prometheus text format, rewritten atomically each step (point node_exporter's
  textfile collector at it, or serve it);
- Weights & Biases and MLflow when metrics.trackers names them (metrics/trackers.py, optional);
and `plot_run(output_dir)` draws reward.png (reward and entropy per step) from metrics.jsonl.
"""

from agl_trainer.metrics.writer import MetricsWriter, read_jsonl
from agl_trainer.metrics.plot import plot_run

__all__ = ["MetricsWriter", "plot_run", "read_jsonl"]
