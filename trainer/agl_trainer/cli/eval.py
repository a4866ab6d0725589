"""`agl eval CONFIG [--checkpoint PATH | --model-url URL] [--KEY VALUE ...]` and `agl eval --compare A B`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Evaluate a checkpoint, or a model served elsewhere, through the same harness, sidecar, runner,
receiver and store as `agl train`: every task of eval.tasks (default: val_tasks, else tasks) is
attempted eval.k times, at sampling.train (eval.mode: train) or sampling.val (eval.mode: val).

Writes to eval.output_dir (a new directory):
  results.json   overall mean@k and pass@1, pass@2, ... pass@k (the unbiased estimator), per task
                 its rewards, mean and pass@j; per rollout its reward and end cause
  receipt.json   what the score depends on: the model's path and sha256 (weights, config, tokenizer),
                 the harness command and its version (git describe; sha256 of the command and the
                 files it names), the budget (k, eval.max_turns, eval.context_tokens, tokens per
                 call, timeout), the sampling (mode, temperature, top_p, seed), the task file's sha256,
                 agl's version and the resolved config, start and end (UTC), the machine
  rollouts.db    the traces: `agl traces serve --store OUTPUT_DIR/rollouts.db`
With metrics.trackers ([wandb, mlflow]) the summary and both files also go to W&B and MLflow.
An attempt that produced no data counts as reward 0. The same config and seed give the same results:
the sidecar seeds every call from config.seed, the rollout and the request.

The harness gets the budgets as AGL_MAX_TURNS and AGL_CONTEXT_TOKENS (when set); a harness that
ignores them is still measured, and its receipt says what it was given.

`agl eval --compare A B` (each an output directory or a receipt.json) prints both results side by
side with B - A, per task and overall; it refuses (exit 1, naming the differing fields) when their
budgets or sampling differ, unless --warn.

examples:
  agl eval examples/demo/config.yaml --checkpoint runs/demo --eval.k 8 --eval.output_dir runs/eval-trained
  agl eval my.yaml --model-url http://gpu-host:8000/v1 --model.name Qwen/Qwen3-8B --eval.output_dir runs/q
  agl eval --compare runs/eval-warm runs/eval-trained
The config keys are `agl train`'s (see `agl train --help`); the eval.* keys are listed there too.
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="evaluate a checkpoint or a served model: pass@k, mean@k, per task, with a receipt",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="the weights: a model directory, a checkpoint (checkpoints/step_N), or a run's "
                        "output directory (its latest checkpoint); default model.path")  # fmt: skip
    parser.add_argument("--model-url", metavar="URL", help="an OpenAI-compatible base URL to evaluate (eval.model_url)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two results (directories or receipts)")
    parser.add_argument("--warn", action="store_true", help="with --compare: warn instead of refusing different budgets")
    parser.add_argument("--check", action="store_true", help="validate the config and exit")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="CONFIG [--KEY VALUE ...]",
                        help="a YAML config (agl train's keys), then config keys as flags")  # fmt: skip
    parser.set_defaults(run=run, _accepts_extra=True)


VALUE_FLAGS = {"--checkpoint": "checkpoint", "--model-url": "model_url"}
BARE_FLAGS = {"--check": "check", "--quiet": "quiet", "--warn": "warn"}


def split_arguments(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """CONFIG and the config overrides, with this command's flags taken out wherever they are."""
    from agl_trainer.cli import CLIError
    from agl_trainer.cli.arguments import split_arguments as split

    def own_flag(item: str, items: Iterator[str], expects_value: bool) -> bool:
        name, _, inline = item.partition("=")
        if name in VALUE_FLAGS and not expects_value:
            value = inline or next(items, None)
            if not value or value.startswith("--"):
                example = "runs/demo" if name == "--checkpoint" else "http://host:8000/v1"
                raise CLIError(f"{name} needs a value, e.g. {name} {example}")
            setattr(args, VALUE_FLAGS[name], value)
        elif item in BARE_FLAGS and not expects_value:
            setattr(args, BARE_FLAGS[item], True)
        elif item == "--compare":
            pair = [next(items, None), next(items, None)]
            if None in pair:
                raise CLIError("--compare needs two results: agl eval --compare RUN_A RUN_B")
            args.compare = pair
        else:
            return False
        return True

    return split(args, "eval", own_flag)


def resolve_checkpoint(path: str) -> Path:
    """A Hugging Face model directory from what --checkpoint names (see its help)."""
    from agl_trainer.config import ConfigError

    root = Path(path)
    candidates = [root, root / "backend" / "model", root / "model"]
    for pointer in (root / "latest", root / "checkpoints" / "latest"):
        if pointer.is_file():
            step = pointer.parent / pointer.read_text().strip()
            candidates += [step / "backend" / "model", step / "model"]
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return candidate
    raise ConfigError(
        f"--checkpoint {path}: no model there (fix: a model directory with config.json, a checkpoint "
        "directory checkpoints/step_N, or a run's output directory with checkpoints/latest)"
    )


def run(args: argparse.Namespace) -> int:
    from agl_trainer.cli import CLIError
    from agl_trainer.config import ConfigError, load_config

    for name in ("checkpoint", "model_url", "compare"):
        setattr(args, name, getattr(args, name, None))
    path, overrides = split_arguments(args)
    if args.compare:
        return compare(args.compare, warn=bool(args.warn), config_path=path, overrides=overrides)
    if path is None and not overrides:
        raise CLIError("agl eval needs a config: agl eval CONFIG.yaml [--checkpoint PATH] (see agl eval --help)")
    try:
        if args.checkpoint:
            overrides.append(f"--model.path={resolve_checkpoint(args.checkpoint)}")
        if args.model_url:
            overrides.append(f"--eval.model_url={args.model_url}")
        config = load_config(path, overrides, check_paths=False)
        from agl_trainer.run.evaluation import check_eval_config
        from agl_trainer.run.topology import resolve

        from agl_trainer.metrics.trackers import check_trackers

        check_eval_config(config)
        resolve(config)
        check_trackers(config)
    except ConfigError as error:
        raise CLIError(str(error)) from None
    if args.check:
        print(f"agl: eval config OK ({config.eval.k} attempts a task, mode {config.eval.mode})")
        return 0
    return evaluate(config, quiet=bool(args.quiet))


def evaluate(config: Any, *, quiet: bool = False) -> int:
    import asyncio

    from agl_trainer.cli import CLIError
    from agl_trainer.config import ConfigError
    from agl_trainer.run.evaluation import run_eval
    from agl_trainer.loop.ports import SidecarError
    from agl_trainer.runners.base import HarnessNotFound

    try:
        result = asyncio.run(run_eval(config, quiet=quiet))
    except (ConfigError, HarnessNotFound, SidecarError) as error:
        raise CLIError(str(error)) from None
    except asyncio.CancelledError:
        print("agl: stopped", file=sys.stderr)
        return 130
    summary = result.summary
    k = int(summary["k"])
    print(
        f"agl eval: {int(summary['tasks'])} tasks x {k}: mean@{k} {summary.get(f'mean@{k}', 0.0):.4f}, "
        f"pass@1 {summary.get('pass@1', 0.0):.4f}, pass@{k} {summary.get(f'pass@{k}', 0.0):.4f}, "
        f"failed {int(summary['failed'])}, {result.rollouts / result.seconds:.2f} rollouts/s"
    )
    print(f"agl eval: wrote {result.output_dir}/results.json, {result.receipt_path}, {result.output_dir}/rollouts.db")
    return 0


def compare(pair: list[str], *, warn: bool, config_path: str | None, overrides: list[str]) -> int:
    from agl_trainer.cli import CLIError
    from agl_trainer.eval.compare import Incomparable
    from agl_trainer.eval.compare import compare as compare_results

    if not warn and (config_path or overrides):  # eval.budget_mismatch: warn in a config also warns
        from agl_trainer.config import ConfigError, load_config

        try:
            warn = load_config(config_path, overrides, check_paths=False).eval.budget_mismatch == "warn"
        except ConfigError as error:
            raise CLIError(str(error)) from None
    try:
        table, found = compare_results(Path(pair[0]), Path(pair[1]), warn=warn)
    except Incomparable as error:
        print(f"agl: error: {error}", file=sys.stderr)
        return 1
    except ValueError as error:
        raise CLIError(str(error)) from None
    for difference in found:
        print(f"agl: warning: {difference}", file=sys.stderr)
    print(table)
    return 0
