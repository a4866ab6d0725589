"""`agl demo` (what `make demo` runs): warm-start a tiny model, then train it by RL through the
whole pipeline (harness -> sidecar -> embedded engine; spans -> receiver -> store -> RL)."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

DEMO_CONFIG = Path("examples/demo/config.yaml")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="the CPU demo: warm start, then collocated-async RL on a toy tool-use task",
        description="Build the tiny demo model, warm-start it (its own phase, reward measured after "
        "it), then train the demo task by RL through the full pipeline in collocated-async mode and "
        "print the reward before and after. Run from the repository root. Writes OUTPUT_DIR "
        "(metrics.jsonl, metrics.prom, tensorboard/, reward.png, checkpoints/, rollouts.db).",
    )
    parser.add_argument("--output-dir", default="runs/demo", help="where it all goes (default runs/demo; replaced)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the model, tasks and sampling (default 0)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="most seconds of RL (default 300)")
    parser.add_argument("--max-steps", type=int, default=None, help="most RL steps (default: the config's)")
    parser.add_argument("--mode", choices=("collocated-async", "sync"), default="collocated-async")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from agl_trainer.cli import CLIError

    if not DEMO_CONFIG.exists():
        raise CLIError(f"{DEMO_CONFIG} not found: run `agl demo` (or `make demo`) from the repository root")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # `examples` is importable from the repo root
    summary = run_demo(
        Path(args.output_dir), seed=args.seed, budget_s=args.budget_s, max_steps=args.max_steps,
        mode=args.mode, quiet=args.quiet,
    )  # fmt: skip
    return 0 if summary["steps"] > 0 else 1


def run_demo(
    out: Path,
    *,
    seed: int = 0,
    budget_s: float = 300.0,
    max_steps: int | None = None,
    mode: str = "collocated-async",
    quiet: bool = False,
    n_tasks: int = 256,
) -> dict[str, Any]:
    """Run the demo; returns the numbers it prints (rewards, steps, seconds)."""
    import asyncio

    from agl_trainer.config import load_config
    from agl_trainer.loop.session import Session
    from examples.demo.prepare import prepare_demo_model
    from examples.demo.task import write_tasks

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    say = (lambda text: None) if quiet else (lambda text: print(text, flush=True))
    say("agl demo 1/2: warm start (supervised, on demonstrations)")
    prepared = prepare_demo_model(out, seed=seed, progress=not quiet)
    say(
        f"  random model reward {prepared.reward_init:.3f} -> after warm start {prepared.reward_warm:.3f}"
        f" ({prepared.warm_start_seconds:.1f} s)"
    )
    tasks = write_tasks(out / "tasks.jsonl", n_tasks, seed)
    overrides = [
        f"--tasks={tasks}",
        f"--output_dir={out}",
        f"--model.path={prepared.path}",
        f"--seed={seed}",
        f"--loop.mode={mode}",
        f"--loop.max_train_s={budget_s}",
    ]
    if max_steps is not None:
        overrides.append(f"--loop.max_steps={max_steps}")
    config = load_config(DEMO_CONFIG, overrides)
    say(f"agl demo 2/2: RL through the pipeline ({mode}, at most {budget_s:.0f} s)")
    started = time.monotonic()
    result = asyncio.run(Session(config, quiet=quiet).run())
    seconds = time.monotonic() - started
    rewards = [row["reward/mean"] for row in result.summary.history if "reward/mean" in row]
    window = max(1, min(10, len(rewards) // 5))
    before = sum(rewards[:window]) / window if rewards else float("nan")
    after = sum(rewards[-window:]) / window if rewards else float("nan")
    summary = {
        "reward_random": prepared.reward_init,
        "reward_warm_start": prepared.reward_warm,
        "reward_rl_first": before,
        "reward_rl_last": after,
        "steps": result.summary.steps,
        "rl_seconds": seconds,
        "window": window,
    }
    print(
        f"agl demo: reward {before:.3f} (first {window} RL steps, after warm start) -> {after:.3f} "
        f"(last {window} of {result.summary.steps} steps, {seconds:.0f} s of RL)\n"
        f"agl demo: wrote {out}/metrics.jsonl, {out}/tensorboard, {out}/reward.png"
    )
    return summary
