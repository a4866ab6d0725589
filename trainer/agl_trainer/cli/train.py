"""`agl train CONFIG.yaml [--resume] [--KEY VALUE ...]`: train a harness with RL."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
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
        description="Start the receiver, engine, sidecar and runners (on loopback unless the config's "
        "sidecar.* / receiver.* addresses say otherwise; or attach to your sidecars) and train the harness on "
        "the tasks, as CONFIG says. With --from-store: train on rollouts collected earlier, no harness, no engine.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The config keys' list imports agl_trainer.config (msgspec, numpy through assembly): built only
    # when this help is shown, so `agl traces ls` and every other command do not pay for it.
    format_help = parser.format_help

    def format_help_with_keys() -> str:
        if parser.epilog is None:
            parser.epilog = _epilog()
        return format_help()

    parser.format_help = format_help_with_keys  # type: ignore[method-assign]
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
        "--from-store",
        metavar="STORE",
        help="train off-policy on rollouts collected earlier in this rollout store (`agl receive --store`), "
        "without running harnesses or an engine; trained rollouts are marked in the store, so the next run "
        "continues (config keys offline.*)",
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
    from agl_trainer.cli.arguments import split_arguments as split

    def own_flag(item: str, items: Iterator[str], expects_value: bool) -> bool:
        if item in FLAGS:
            setattr(args, item[2:].replace("-", "_"), True)
        elif item == "--from-store":
            args.from_store = _store_value(next(items, None))
        elif item.startswith("--from-store="):
            args.from_store = _store_value(item.split("=", 1)[1])
        elif item == "--gpu-memory-gib":
            args.gpu_memory_gib = _gib_value(next(items, None))
        elif item.startswith("--gpu-memory-gib="):
            args.gpu_memory_gib = _gib_value(item.split("=", 1)[1])
        else:
            return False
        return True

    return split(args, "train", own_flag)


def _gib_value(text: str | None) -> float:
    from agl_trainer.cli import CLIError

    try:
        value = float(text) if text is not None else 0.0
    except ValueError:
        value = 0.0
    if not value > 0:
        raise CLIError(f"--gpu-memory-gib needs a positive number of GiB, got {text!r} (e.g. --gpu-memory-gib 141)")
    return value


def _store_value(text: str | None) -> str:
    from agl_trainer.cli import CLIError

    if not text or text.startswith("--"):
        raise CLIError("--from-store needs the path of a rollout store, e.g. --from-store runs/traces.db")
    return text


def run(args: argparse.Namespace) -> int:
    from agl_trainer.cli import CLIError
    from agl_trainer.config import ConfigError, load_config

    try:
        path, overrides = split_arguments(args)
        from_store = getattr(args, "from_store", None)
        config = load_config(path, overrides, check_paths=from_store is None)
        if from_store is not None:
            check_offline_config(config)
        else:  # addresses and the secrets' variables, also for --check and --dry-run
            from agl_trainer.run.topology import resolve

            resolve(config)
        from agl_trainer.metrics.trackers import check_trackers

        check_trackers(config)
    except ConfigError as error:
        raise CLIError(str(error)) from None
    if from_store is not None and not (getattr(args, "dry_run", False) or args.check):
        return train_offline(config, from_store, resume=args.resume, quiet=args.quiet)
    if getattr(args, "dry_run", False):
        return dry_run(config, float(getattr(args, "gpu_memory_gib", DEFAULT_GPU_MEMORY_GIB)))
    if args.check:
        print(f"agl: config OK ({config.loop.mode}, {config.loop.batch_rollouts} rollouts a step)")
        return 0
    return train(config, resume=args.resume, quiet=args.quiet)


def check_offline_config(config: Any) -> None:
    """--from-store runs no harness and no engine: only the model must exist."""
    from pathlib import Path

    from agl_trainer.config import ConfigError, check_loop

    if config.model.path is None:
        raise ConfigError("config key model.path: missing (fix: a Hugging Face model directory)")
    if not Path(config.model.path).exists():
        raise ConfigError(f"config key model.path: {config.model.path} does not exist (fix: a model directory)")
    check_loop(config.loop)


def train_offline(config: Any, store: str, *, resume: bool = False, quiet: bool = False) -> int:
    """The training loop with the stored rollout source (loop/stored.py): nothing generated."""
    import asyncio

    from agl_trainer.cli import CLIError
    from agl_trainer.config import ConfigError
    from agl_trainer.run.session import Session
    from agl_trainer.store import StoreError

    try:
        result = asyncio.run(Session(config, resume=resume, quiet=quiet, from_store=store).run())
    except (ConfigError, StoreError) as error:
        raise CLIError(str(error)) from None
    except asyncio.CancelledError:
        print("agl: stopped (rollouts trained since the last checkpoint are trained again next time)", file=sys.stderr)
        return 130
    summary, stored = result.summary, result.stored
    assert stored is not None
    rewards = [row["reward/mean"] for row in summary.history if "reward/mean" in row]
    trained = sum(int(row.get("rollouts/trained", 0)) for row in summary.history)
    print(f"agl: {len(summary.history)} offline steps on {trained} rollouts from {store}")
    if rewards:
        print(f"agl: mean reward of the trained rollouts: first step {rewards[0]:.3f}, last step {rewards[-1]:.3f}")
    if stored.dropped:
        print(f"agl: dropped (recorded in the store): {stored.dropped}")
    if stored.waiting:
        print(f"agl: {stored.waiting} rollouts wait for a later run (a group too small, or no reward yet)")
    if stored.ahead:
        print(
            f"agl: {stored.ahead} rollouts skipped: their calls say a policy version newer than the weights"
            f" trained ({summary.policy_version}); if model.path is a later version, set offline.policy_version"
        )
    if result.checkpoint is not None:
        print(f"agl: weights {result.checkpoint}")
    return 0


def dry_run(config: Any, gpu_memory_gib: float) -> int:
    """Print the memory arithmetic per GPU; 0 when the run fits, 1 when it does not."""
    from agl_trainer.cli import CLIError
    from agl_trainer.config import ConfigError
    from agl_trainer.resources import ArchitectureError, format_plan, plan_resources
    from agl_trainer.resources.lora import LoraTargetError
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
    except LoraTargetError as error:  # the backend refuses the same when the model loads
        raise CLIError(f"config key backend.lora.target_modules: {error}") from None
    print(format_plan(plan))
    return 0 if plan.fits else 1


def train(config: Any, *, resume: bool = False, quiet: bool = False) -> int:
    import asyncio

    from agl_trainer.cli import CLIError
    from agl_trainer.config import ConfigError
    from agl_trainer.loop.canary import CanaryStop
    from agl_trainer.run.session import Session
    from agl_trainer.runners.base import HarnessNotFound
    from agl_trainer.loop.ports import SidecarError

    try:
        result = asyncio.run(Session(config, resume=resume, quiet=quiet).run())
    except (ConfigError, HarnessNotFound, SidecarError, CanaryStop) as error:
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
