"""`agl train CONFIG.yaml [--resume] [--KEY VALUE ...]`: train a harness with RL."""

from __future__ import annotations

import argparse
import sys
from typing import Any

EPILOG_HEAD = """\
Every config key is also a flag: --loop.batch_rollouts 64, --backend.lr=1e-3, --set loop.mode=sync.
The run writes OUTPUT_DIR/{metrics.jsonl, metrics.prom, tensorboard/, reward.png, checkpoints/,
rollouts.db, rollouts/*.log, sidecar.log}. Ctrl-C stops after the current step (twice: now).

config keys (default):
"""
DEFAULT_GPU_MEMORY_GIB = 80.0
FLAGS = ("--resume", "--quiet", "--check", "--dry-run")


def _epilog() -> str:
    from agl_trainer.config import describe_keys

    lines = [EPILOG_HEAD]
    for key, default, description in describe_keys():
        shown = "" if default is None or default == {} else f" ({default})"
        lines.append(f"  {key}{shown}\n      {description}")
    return "\n".join(lines)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a harness with RL (sync or collocated-async)",
        description="Start the receiver, engine, sidecar and runners on loopback and train the "
        "harness on the tasks, as CONFIG says.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--resume", action="store_true", help="continue the run in output_dir from its last checkpoint")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--check", action="store_true", help="validate the config and exit")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config and print the memory per GPU (model, gradients, AdamW, KV cache); "
        "starts nothing; exit 1 when it does not fit",
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=DEFAULT_GPU_MEMORY_GIB,
        help=f"GPU memory for --dry-run (default {DEFAULT_GPU_MEMORY_GIB:g}; an H200 has 141)",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="CONFIG [--KEY VALUE ...]",
                        help="a YAML config (keys below), then config keys as flags")
    parser.set_defaults(run=run, _accepts_extra=True)


def split_arguments(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """CONFIG and the overrides, wherever --resume/--quiet/--check/--dry-run/--gpu-memory-gib appear."""
    argv = list(getattr(args, "argv", []) or [])
    if "train" in argv:  # the raw order: argparse moves unknown flags away from their values
        rest = argv[argv.index("train") + 1 :]
    else:
        rest = list(args.args or []) + list(getattr(args, "extra", []) or [])
    config: str | None = None
    overrides: list[str] = []
    expects_value = False
    items = iter(rest)
    for item in items:
        if item in FLAGS:
            setattr(args, item[2:].replace("-", "_"), True)
        elif item == "--gpu-memory-gib":
            args.gpu_memory_gib = _gib_value(next(items, None))
        elif item.startswith("--gpu-memory-gib="):
            args.gpu_memory_gib = _gib_value(item.split("=", 1)[1])
        elif config is None and not item.startswith("--") and not expects_value:
            config = item
        else:
            overrides.append(item)
            expects_value = item.startswith("--") and "=" not in item and not expects_value
            continue
        expects_value = False
    return config, overrides


def _gib_value(text: str | None) -> float:
    from agl_trainer.cli import CLIError

    try:
        value = float(text) if text is not None else 0.0
    except ValueError:
        value = 0.0
    if not value > 0:
        raise CLIError(f"--gpu-memory-gib needs a positive number of GiB, got {text!r} (e.g. --gpu-memory-gib 141)")
    return value


def run(args: argparse.Namespace) -> int:
    from agl_trainer.cli import CLIError
    from agl_trainer.config import ConfigError, load_config

    try:
        path, overrides = split_arguments(args)
        config = load_config(path, overrides)
    except ConfigError as error:
        raise CLIError(str(error)) from None
    if getattr(args, "dry_run", False):
        return dry_run(config, float(getattr(args, "gpu_memory_gib", DEFAULT_GPU_MEMORY_GIB)))
    if args.check:
        print(f"agl: config OK ({config.loop.mode}, {config.loop.batch_rollouts} rollouts a step)")
        return 0
    return train(config, resume=args.resume, quiet=args.quiet)


def dry_run(config: Any, gpu_memory_gib: float) -> int:
    """Print the memory arithmetic per GPU; 0 when the run fits, 1 when it does not."""
    from agl_trainer.cli import CLIError
    from agl_trainer.config import ConfigError
    from agl_trainer.resources import ArchitectureError, format_plan, plan_resources
    from agl_trainer.resources.settings import check_settings

    try:
        check_settings(config)
    except ConfigError as error:
        raise CLIError(str(error)) from None
    print(f"agl: config OK ({config.loop.mode}, {config.loop.batch_rollouts} rollouts a step)")
    try:
        plan = plan_resources(config, gpu_memory_gib)
    except ArchitectureError as error:
        raise CLIError(f"config key model.path: {error}") from None
    print(format_plan(plan))
    return 0 if plan.fits else 1


def train(config: Any, *, resume: bool = False, quiet: bool = False) -> int:
    import asyncio

    from agl_trainer.cli import CLIError
    from agl_trainer.config import ConfigError
    from agl_trainer.loop.session import Session
    from agl_trainer.runners.base import HarnessNotFound
    from agl_trainer.loop.sidecar_client import SidecarError

    try:
        result = asyncio.run(Session(config, resume=resume, quiet=quiet).run())
    except (ConfigError, HarnessNotFound, SidecarError) as error:
        raise CLIError(str(error)) from None
    except asyncio.CancelledError:
        print("agl: stopped", file=sys.stderr)
        return 130
    history = result.summary.history
    rewards = [row["reward/mean"] for row in history if "reward/mean" in row]
    print(f"agl: {result.summary.steps} steps, policy version {result.summary.policy_version}")
    if rewards:
        print(f"agl: mean reward first step {rewards[0]:.3f}, last step {rewards[-1]:.3f}")
    if result.summary.failures:
        print(f"agl: failed rollouts by cause: {result.summary.failures}")
    if result.plot is not None:
        print(f"agl: plot {result.plot}")
    return 0
