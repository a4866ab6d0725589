"""The demo end to end, what `agl demo` (= `make demo`) runs: build and warm-start the tiny model,
write the tasks, then train by RL through the whole pipeline (harness -> sidecar -> embedded
engine; spans -> receiver -> store -> RL) and report the reward before and after.

    from examples.demo.run import run_demo
    summary = run_demo(Path("runs/demo"), seed=0, budget_s=300)   # run from the repository root
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from examples.demo.prepare import prepare_demo_model, warm_start_tasks
from examples.demo.task import Split, answer_pair, make_tasks, shown_pairs, split_pairs, write_tasks

DEMO_CONFIG = Path("examples/demo/config.yaml")  # its paths are relative to the repository root
SAMPLED_KEY = "val/sampled/reward"  # the held-out gain the demo reports (loop/validation.py)
# The demo's validation rounds report on the test split: nothing is chosen on them (the reserve's
# size was looked at on the `val` split, `python -m examples.demo.tasks --split val`)
HELD_OUT_SPLIT: Split = "test"


def run_demo(
    out: Path,
    *,
    seed: int = 0,
    budget_s: float = 300.0,
    max_steps: int | None = None,
    mode: str = "collocated-async",
    quiet: bool = False,
    n_tasks: int = 256,
    n_val_tasks: int = 32,
    val_every: int | None = None,
    overrides: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the demo; returns the numbers it prints (rewards, steps, seconds). `overrides`: config
    flags (`--backend.lora.rank=8`) applied after the demo's own."""
    import asyncio

    from agl_trainer.config import load_config
    from agl_trainer.models.hf_progress import quiet_progress
    from agl_trainer.run.session import Session

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    say = (lambda text: None) if quiet else (lambda text: print(text, flush=True))
    say("agl demo 1/2: warm start (supervised, on demonstrations)")
    with quiet_progress():  # the warm start shows its own bar; no "Loading weights" at each load
        prepared = prepare_demo_model(out, seed=seed, progress=not quiet)
    say(
        f"  random model reward {prepared.reward_init:.3f} -> after warm start {prepared.reward_warm:.3f}"
        f" ({prepared.warm_start_seconds:.1f} s; sampled, on held-out tasks)"
    )
    tasks = write_tasks(out / "tasks.jsonl", n_tasks, seed)
    trained = [*make_tasks(n_tasks, seed), *warm_start_tasks(seed)]
    val_tasks = write_val_tasks(out / "val_tasks.jsonl", n_val_tasks, seed, exclude=trained)
    flags = [
        f"--tasks={tasks}",
        f"--val_tasks={val_tasks}",
        f"--output_dir={out}",
        f"--model.path={prepared.path}",
        f"--seed={seed}",
        f"--loop.mode={mode}",
        f"--loop.max_train_s={budget_s}",
    ]
    if max_steps is not None:
        flags.append(f"--loop.max_steps={max_steps}")
    if val_every is not None:
        flags.append(f"--loop.val_every={val_every}")
    config = load_config(DEMO_CONFIG, [*flags, *overrides])
    say(f"agl demo 2/2: RL through the pipeline ({mode}, at most {budget_s:.0f} s)")
    started = time.monotonic()
    result = asyncio.run(Session(config, quiet=quiet).run())
    seconds = time.monotonic() - started
    rewards = [row["reward/mean"] for row in result.summary.history if "reward/mean" in row]
    window = max(1, min(10, len(rewards) // 5))
    before = sum(rewards[:window]) / window if rewards else float("nan")
    after = sum(rewards[-window:]) / window if rewards else float("nan")
    validation = [row["val/reward"] for row in result.summary.validation if "val/reward" in row]
    sampled = [row for row in result.summary.validation if SAMPLED_KEY in row]
    summary = {
        "reward_random": prepared.reward_init,
        "reward_warm_start": prepared.reward_warm,
        "reward_rl_first": before,
        "reward_rl_last": after,
        "steps": result.summary.steps,
        "rl_seconds": seconds,
        "window": window,
        "val_reward_first": validation[0] if validation else float("nan"),
        "val_reward_last": validation[-1] if validation else float("nan"),
        "val_rounds": len(validation),
        "val_sampled_first": sampled[0][SAMPLED_KEY] if sampled else float("nan"),
        "val_sampled_last": sampled[-1][SAMPLED_KEY] if sampled else float("nan"),
    }
    gain = ""
    if sampled:
        first, last, k = sampled[0][SAMPLED_KEY], sampled[-1][SAMPLED_KEY], sampled[-1]["val/sampled/k"]
        gain = (
            f"agl demo: held-out gain: {SAMPLED_KEY} (mean@{k:.0f} at the training temperature, on the "
            f"{n_val_tasks} held-out tasks) {first:.3f} before RL -> {last:.3f} at step "
            f"{sampled[-1]['step']:.0f} ({last - first:+.3f})\n"
        )
    print(
        f"agl demo: reward {before:.3f} (first {window} RL steps, after warm start) -> {after:.3f} "
        f"(last {window} of {result.summary.steps} steps, {seconds:.0f} s of RL)\n"
        + f"agl demo: held-out: {held_out_description(n_val_tasks)}\n"
        + gain
        + (
            f"agl demo: val/reward (greedy, the same held-out tasks) {validation[0]:.3f} before RL -> "
            f"{validation[-1]:.3f} at the end ({len(validation)} rounds)\n"
            if validation
            else ""
        )
        + f"agl demo: wrote {out}/metrics.jsonl, {out}/tensorboard, {out}/reward.png"
    )
    return summary


def held_out_description(n: int, split: Split = HELD_OUT_SPLIT) -> str:
    """What the demo's validation measures, as its output says it."""
    pairs = len(split_pairs(split))
    return (
        f"{n} tasks ({split} split) over {min(n, pairs)} (key, value) pairs the training never shows: "
        f"every key and every value is trained, never these pairs together (examples/demo/task.py)"
    )


def write_val_tasks(
    path: Path, n: int, seed: int, *, exclude: Sequence[dict[str, Any]] = (), split: Split = HELD_OUT_SPLIT
) -> Path:
    """Held-out tasks of `split` (ids `test-NNNNN`): their (key, value) pairs are in no training
    table, by construction (task.split_of). `exclude`: tasks to check that against (a training set
    written elsewhere); a held-out pair one of them shows is a ValueError, never skipped silently."""
    import json

    if split == "train":
        raise ValueError("write_val_tasks: split 'train' is not held out; use 'val' or 'test'")
    tasks = make_tasks(n, seed + 10_000, split)
    if shown := sorted({answer_pair(task) for task in tasks} & shown_pairs(exclude)):
        raise ValueError(
            f"write_val_tasks: held-out pairs {shown[:3]} are in the excluded tasks' tables: those "
            f"tasks are not training-split tasks (fix: make them with make_tasks(..., split='train'))"
        )
    path.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    return path
