"""The model a run trained, read from the record the run left beside its store, so the viewer
decodes tokens without `--model`.

`agl train` writes its config to OUTPUT_DIR/config.yaml (run/session.py). Its `model.path` may be
relative to the directory the run ran in; that directory is the run directory with the config's
own `output_dir` taken off its end (`runs/demo/model-warm` with `output_dir: runs/demo`, opened as
/home/me/agl/runs/demo: /home/me/agl/runs/demo/model-warm), wherever the viewer is started.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

RUN_CONFIG = "config.yaml"


def run_model(run_dir: Path) -> str | None:
    """The run's model directory when `run_dir` holds a run's config.yaml and the model is there
    still; None otherwise (the viewer then shows token ids)."""
    try:
        record = yaml.safe_load((run_dir / RUN_CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError):  # RecursionError: nested past the parser
        return None
    if not isinstance(record, dict) or not isinstance(record.get("model"), dict):
        return None
    path = record["model"].get("path")
    if not isinstance(path, str) or not path:
        return None
    model = Path(path)
    if not model.is_absolute():
        base = _run_cwd(run_dir.resolve(), record.get("output_dir"))
        if base is None:
            return None
        model = base / model
    return str(model) if model.is_dir() else None


def _run_cwd(run_dir: Path, output_dir: object) -> Path | None:
    """The directory the run ran in: `run_dir` less the config's relative `output_dir`."""
    if not isinstance(output_dir, str) or not output_dir:
        return None
    parts = Path(os.path.normpath(output_dir)).parts
    if Path(output_dir).is_absolute() or ".." in parts:
        return None  # an absolute output_dir says nothing of where the run ran
    if parts == (".",):
        return run_dir
    if run_dir.parts[-len(parts) :] != parts:
        return None
    return Path(*run_dir.parts[: -len(parts)])
