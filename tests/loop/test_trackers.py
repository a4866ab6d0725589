"""Weights & Biases (offline mode, its run directory read back) and MLflow (a file store, read back
with MlflowClient) get what metrics.jsonl gets; a tracker that cannot start is a config error, one
failing mid-run warns once and never stops the writer; neither is imported unless configured."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agl_trainer.config import ConfigError, load_config
from agl_trainer.metrics import MetricsWriter, read_jsonl
from agl_trainer.metrics.trackers import start_trackers

from tests.support.wandb_offline import read_run


def tracked_config(tmp_path: Path, *extra: str):  # noqa: ANN201
    return load_config(
        None,
        ["--metrics.trackers=[wandb, mlflow]", "--metrics.wandb.mode=offline", "--metrics.wandb.run_name=t",
         f"--metrics.mlflow.tracking_uri={(tmp_path / 'mlruns').as_uri()}", "--metrics.mlflow.experiment=exp", *extra],
        check_paths=False,
    )  # fmt: skip


def mlflow_runs(store: Path, experiment: str = "agl") -> list[dict[str, list[tuple[int, float]]]]:
    """Each run of the experiment in the MLflow file store: every metric's (step, value) history."""
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.as_uri())
    found = client.get_experiment_by_name(experiment)
    return [
        {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics}
        for run in client.search_runs([found.experiment_id])
    ]


def mlflow_history(tmp_path: Path, name: str) -> dict[str, list[tuple[int, float]]]:
    (run,) = mlflow_runs(tmp_path / "mlruns", "exp")
    return {key: history for key, history in run.items() if key == name or name == "*"}


def test_metrics_reach_wandb_offline_and_an_mlflow_file_store(tmp_path: Path) -> None:
    config = tracked_config(tmp_path, "--loop.group_size=4")
    out = tmp_path / "run"
    writer = MetricsWriter(out, tensorboard=False, trackers=start_trackers(config, out, kind="train"))
    writer.write(1, {"reward/mean": 0.25, "loss": 1.5})
    writer.write(2, {"reward/mean": 0.75, "val/sampled/pass@k": 1.0})
    writer.close()
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    recorded = read_run(run_dir)
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} | {"step": row["_step"]} for row in recorded["history"]]
    assert rows == [
        {"reward/mean": 0.25, "loss": 1.5, "step": 1},
        {"reward/mean": 0.75, "val/sampled/pass@k": 1.0, "step": 2},
    ]
    assert recorded["config"]["loop"]["group_size"] == 4  # the resolved config is the run's config
    history = mlflow_history(tmp_path, "*")
    assert history["reward/mean"] == [(1, 0.25), (2, 0.75)]
    assert history["val/sampled/pass_k"] == [(2, 1.0)]  # '@' is not allowed in an MLflow name
    assert [row["reward/mean"] for row in read_jsonl(out / "metrics.jsonl")] == [0.25, 0.75]


def test_a_tracker_failing_mid_run_warns_once_and_the_rest_go_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tracked_config(tmp_path, "--metrics.trackers=[mlflow]")
    out = tmp_path / "run"
    writer = MetricsWriter(out, tensorboard=False, trackers=start_trackers(config, out, kind="train"))
    writer.write(1, {"reward/mean": 0.5})
    shutil.rmtree(tmp_path / "mlruns")  # the store goes away under the run
    writer.write(2, {"reward/mean": 0.6})
    writer.write(3, {"reward/mean": 0.7})
    writer.close()
    err = capsys.readouterr().err
    assert err.count("metrics tracker mlflow failed") == 1
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


def test_a_tracker_that_cannot_start_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tracked_config(tmp_path, "--metrics.trackers=[mlflow]", "--metrics.mlflow.tracking_uri=bogus://nowhere")
    with pytest.raises(ConfigError, match=r"config key metrics.mlflow: mlflow could not start a run .*bogus"):
        start_trackers(config, tmp_path, kind="train")
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    config = tracked_config(tmp_path, "--metrics.trackers=[wandb]")
    with pytest.raises(ConfigError, match=r"metrics.trackers: wandb is not installed .*agl\[trackers\]"):
        start_trackers(config, tmp_path, kind="train")
    with pytest.raises(ConfigError, match="metrics.trackers"):
        load_config(None, ["--metrics.trackers=[neptune]"], check_paths=False)
    # `agl train --check` says so before anything starts (the package is looked for, not imported)
    from agl_trainer.metrics.trackers import check_trackers

    monkeypatch.undo()  # wandb importable again
    check_trackers(tracked_config(tmp_path))  # both installed here
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "mlflow" else object())
    with pytest.raises(ConfigError, match=r"metrics.trackers: mlflow is not installed"):
        check_trackers(tracked_config(tmp_path))


def test_trackers_are_not_imported_unless_configured() -> None:
    code = (
        "import sys, agl_trainer, agl_trainer.config, agl_trainer.metrics\n"
        "from agl_trainer.cli import build_parser\n"
        "build_parser().parse_args(['train', '--help']) if False else build_parser()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'mlflow')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
    help_text = subprocess.run(
        [sys.executable, "-c", "import sys; from agl_trainer.cli import main\ntry: main(['train', '--help'])\n"
         "except SystemExit: pass\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'mlflow')))"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert help_text.stdout.strip().endswith("[]") and "metrics.trackers" in help_text.stdout
