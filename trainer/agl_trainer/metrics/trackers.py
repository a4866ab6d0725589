"""Experiment trackers: Weights & Biases and MLflow get what metrics.jsonl gets, when configured
(`metrics.trackers: [wandb, mlflow]`, settings metrics.wandb.* and metrics.mlflow.*).

Both are optional (`pip install 'agl[trackers]'`) and imported only here, only when configured.
A tracker that cannot start (not installed, bad settings, server unreachable) is a config error
before anything else starts; one that fails later warns once and is dropped: training goes on, the
JSONL, Prometheus and TensorBoard outputs keep everything.

    trackers = start_trackers(config, output_dir, kind="train")   # or "eval"
    trackers.log(step, {"reward/mean": 0.6})
    trackers.finish_eval(summary, files)                          # an evaluation's result
    trackers.close()

MLflow metric names allow only [A-Za-z0-9_-. :/]: other characters become `_` (`pass@4` is
`pass_4` there). A `file:` tracking URI is MLflow's file store, which MLflow 3 only opens with
MLFLOW_ALLOW_FILE_STORE=true: naming a file: URI here sets it for this process.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agl_trainer.config import Config, ConfigError, resolved_config

INSTALL_HINT = "pip install 'agl[trackers]'"


class Tracker:
    name = "tracker"

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def summary(self, values: dict[str, float], files: list[Path]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, settings: Any, out: Path, run_config: dict[str, Any], kind: str) -> None:
        import wandb

        self._wandb = wandb
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.run_name or out.resolve().name,
            dir=str(out),
            mode=settings.mode,
            tags=list(settings.tags) or None,
            job_type=kind,
            config=run_config,
            reinit="create_new",
            # quiet: no run summary printed at the end; console off: agl's own output is not wrapped
            settings=wandb.Settings(quiet=True, console="off"),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def summary(self, values: dict[str, float], files: list[Path]) -> None:
        self.run.summary.update(values)
        for path in files:
            self.run.save(str(path), base_path=str(path.parent), policy="now")

    def close(self) -> None:
        self.run.finish()


@contextlib.contextmanager
def _argv_redacted(secrets: set[str]) -> Iterator[None]:
    """sys.argv with its secrets redacted (a --model-url password), for a library that records it."""
    from agl_trainer.redaction import redact_argv

    argv = sys.argv
    sys.argv = redact_argv(argv, secrets)
    try:
        yield
    finally:
        sys.argv = argv


_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-. :/]")


def mlflow_name(name: str) -> str:
    return _MLFLOW_BAD.sub("_", name)


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, settings: Any, out: Path, run_config: dict[str, Any], kind: str) -> None:
        uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (out.resolve() / "mlruns").as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # see the module's docstring
        # Metrics are logged from the training loop: a server gone must not hold a step for MLflow's
        # default retries (7, with backoff: minutes). Two tries of 10 s, then the tracker is dropped.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric, self._param = Metric, Param
        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        experiment = self.client.get_experiment_by_name(settings.experiment)
        experiment_id = (
            experiment.experiment_id if experiment is not None else self.client.create_experiment(settings.experiment)
        )
        run = self.client.create_run(
            experiment_id, run_name=settings.run_name or out.resolve().name, tags={"agl.kind": kind}
        )
        self.run_id = run.info.run_id
        params = [Param(key[:250], str(value)[:6000]) for key, value in _flatten(run_config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        now = int(time.time() * 1000)
        items = [
            self._metric(mlflow_name(key), float(value), now, step)
            for key, value in metrics.items()
            if math.isfinite(float(value))
        ]
        for start in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[start : start + 1000])

    def summary(self, values: dict[str, float], files: list[Path]) -> None:
        self.log(0, values)
        for path in files:
            self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


class Trackers:
    """The configured trackers; a failure after start warns once and drops that tracker."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def _each(self, action: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, action)(*args)
            except Exception as error:  # noqa: BLE001 - a tracker never stops training
                self.trackers.remove(tracker)
                print(
                    f"agl: warning: metrics tracker {tracker.name} failed ({type(error).__name__}: {error}); "
                    "it gets no more metrics this run (metrics.jsonl, metrics.prom and tensorboard/ still do)",
                    file=sys.stderr,
                )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._each("log", step, metrics)

    def summary(self, values: dict[str, float], files: list[Path]) -> None:
        self._each("summary", values, files)

    def close(self) -> None:
        self._each("close")
        self.trackers = []


BUILDERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}


def check_trackers(config: Config) -> None:
    """Each configured tracker's package is installed (found, not imported): for --check."""
    import importlib.util

    for name in config.metrics.trackers:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ConfigError(
                f"config key metrics.trackers: {name} is not installed (fix: {INSTALL_HINT}, or remove {name} "
                "from metrics.trackers)"
            )


def start_trackers(config: Config, out: Path, *, kind: str) -> Trackers:
    """Start each tracker of metrics.trackers; ConfigError naming the tracker when one cannot start."""
    from agl_trainer.redaction import redact, secret_values

    started: list[Tracker] = []
    names = list(dict.fromkeys(config.metrics.trackers))
    resolved = resolved_config(config) if names else {}
    run_config = redact(resolved)  # params, the run's config and the trackers' logs: no secrets
    for name in names:
        settings = getattr(config.metrics, name)
        try:
            with _argv_redacted(secret_values(resolved)):  # W&B records the command line as it starts
                started.append(BUILDERS[name](settings, out, run_config, kind))
        except ImportError as error:
            Trackers(started).close()
            raise ConfigError(
                f"config key metrics.trackers: {name} is not installed ({error}) (fix: {INSTALL_HINT}, or remove "
                f"{name} from metrics.trackers)"
            ) from None
        except Exception as error:  # noqa: BLE001 - whatever the tracker raises, said as a config error
            Trackers(started).close()
            raise ConfigError(
                f"config key metrics.{name}: {name} could not start a run ({type(error).__name__}: {error}) (fix: "
                f"check metrics.{name}.* and the tracker's credentials, or remove {name} from metrics.trackers)"
            ) from None
    return Trackers(started)
