"""`agl demo` (what `make demo` runs): the command line of examples/demo/run.py, which holds the
demo (warm start, then RL through the whole pipeline). The demo lives in the repository, not in
the wheel, so the command runs from the repository root and imports `examples.demo` from there."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DEMO_CONFIG = Path("examples/demo/config.yaml")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="the CPU demo: warm start, then collocated-async RL on a toy tool-use task",
        description="Build the tiny demo model, warm-start it (its own phase, reward measured after "
        "it), then train the demo task by RL through the full pipeline in collocated-async mode and "
        "print the training reward before and after and the held-out gain (val/sampled/reward: 32 "
        "held-out tasks whose (key, value) pairs the training never shows, 4 samples each at the "
        "training temperature). Run from the repository root. Writes OUTPUT_DIR "
        "(metrics.jsonl, metrics.prom, tensorboard/, reward.png, checkpoints/, rollouts.db).",
    )
    parser.add_argument("--output-dir", default="runs/demo", help="where it all goes (default runs/demo; replaced)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the model, tasks and sampling (default 0)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="most seconds of RL (default 300)")
    parser.add_argument("--max-steps", type=int, default=None, help="most RL steps (default: the config's)")
    parser.add_argument("--mode", choices=("collocated-async", "sync"), default="collocated-async")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.epilog = (
        "Any other --KEY VALUE is a config override applied after the demo's own, as `agl train` takes "
        "them (e.g. --backend.lora.rank 8: LoRA adapters instead of full training, on the config's "
        "backend.lora.target_modules: the projections and the output head, where the tiny model's skill is)."
    )
    parser.set_defaults(run=run, _accepts_extra=True)


def run(args: argparse.Namespace) -> int:
    from agl_trainer.cli import CLIError

    if not DEMO_CONFIG.exists():
        raise CLIError(f"{DEMO_CONFIG} not found: run `agl demo` (or `make demo`) from the repository root")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # `examples` is importable from the repo root
    from examples.demo.run import run_demo

    overrides = list(getattr(args, "extra", []) or [])
    if overrides and not overrides[0].startswith("--"):
        raise CLIError(f"agl demo takes no config file ({overrides[0]!r}); config keys go as --KEY VALUE")
    from agl_trainer.config import ConfigError, load_config

    try:
        # a bad key or value fails here, before the warm start; the config's paths (tasks, the warm
        # model) are the demo's own, written before training
        load_config(DEMO_CONFIG, overrides, check_paths=False)
    except ConfigError as error:
        raise CLIError(str(error)) from None
    summary = run_demo(
        Path(args.output_dir), seed=args.seed, budget_s=args.budget_s, max_steps=args.max_steps,
        mode=args.mode, quiet=args.quiet, overrides=overrides,
    )  # fmt: skip
    return 0 if summary["steps"] > 0 else 1
