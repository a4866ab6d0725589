"""The demo pipeline as the benches run it: their --quick/--steps options, a warm-started demo model
in a fresh work folder, and a run of examples/demo/config.yaml with the bench's overrides."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def steps_option(doc: str | None, quick_steps: int, steps: int, quick_help: str) -> int:
    """The number of training steps from the command line: --steps N, or fewer with --quick."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    return args.steps or (quick_steps if args.quick else steps)


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
    from agl_trainer.config import load_config
    from agl_trainer.loop.session import Session

    config = load_config(ROOT / "examples/demo/config.yaml", overrides)
    return asyncio.run(Session(config, quiet=True).run()).summary.history
