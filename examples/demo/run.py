"""The demo end to end, what `agl demo` (= `make demo`) runs: build and warm-start the tiny model,
write the tasks, then train by RL through the whole pipeline (harness -> sidecar -> embedded
engine; spans -> receiver -> store -> RL) and report the reward before and after.

    from examples.demo.run import run_demo
    summary = run_demo(Path("runs/demo"), seed=0, budget_s=300)   # run from the repository root
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from examples.demo.prepare import prepare_demo_model
from examples.demo.task import write_tasks

DEMO_CONFIG = Path("examples/demo/config.yaml")  # its paths are relative to the repository root


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
