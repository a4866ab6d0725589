"""The demo pipeline as the benches run it: their --quick/--steps options, a warm-started demo model
in a fresh work folder, and a run of examples/demo/config.yaml with the bench's overrides."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def steps_option(doc: str | None, quick_steps: int, steps: int, quick_help: str) -> int:
    """The number of training steps from the command line: --steps N, or fewer with --quick."""
    return bench_args(doc, quick_steps, steps, quick_help).steps


def bench_args(
    doc: str | None,
    quick_steps: int,
    steps: int,
    quick_help: str,
    configure: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The command line of a demo bench: --quick, --steps N (resolved), plus what `configure` adds."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--steps", type=int, default=None)
    if configure is not None:
        configure(parser)
    args = parser.parse_args()
    args.steps = args.steps or (quick_steps if args.quick else steps)
    return args


@dataclass
class DemoWork:
    folder: Path  # a fresh temporary folder
    model: Path  # the warm-started demo model in it


def demo_work(prefix: str) -> DemoWork:
    from examples.demo.prepare import prepare_demo_model

    folder = Path(tempfile.mkdtemp(prefix=prefix))
    return DemoWork(folder, prepare_demo_model(folder, seed=0, progress=False).path)


def run_demo(overrides: list[str]) -> list[dict[str, Any]]:
    """Train with the demo's config and `overrides`; each step's metrics row."""
    return run_config(ROOT / "examples/demo/config.yaml", overrides).history


def run_config(config_path: Path, overrides: list[str]) -> Any:
    """Train with `config_path` and `overrides` in this process; the run's summary (`history`: each
    step's metrics row; `validation`: each round's). The trace viewer is off (its indexer would take
    CPU from what the bench measures) unless the overrides say."""
    from agl_trainer.config import load_config
    from agl_trainer.run.session import Session

    config = load_config(config_path, ["--viewer.enabled=false", *overrides])
    return asyncio.run(Session(config, quiet=True).run()).summary
