"""One training step through the whole pipeline vs the same step in one process with no pipeline.

    python bench/pipeline_overhead.py [--quick]

Pipeline: runner workers -> agl-sidecar (subprocess) -> embedded engine; spans -> receiver -> SQLite
store -> assembly -> torch backend -> weights back into the engine (mode sync, so a step is exactly
one batch). Reference: examples/demo/inprocess.py (batched sampling and a GRPO update in one
process). Same warm-started demo model, same task, 16 tasks x 8 episodes, 2 calls each.
Prints the mean step time of each, their ratio (target: pipeline within 10x), and where the
pipeline's time goes.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from _demo_run import demo_work, run_demo, steps_option

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    steps = steps_option(__doc__, 3, 8, "fewer steps (under a minute of measuring)")
    from examples.demo.inprocess import time_step
    from examples.demo.task import write_tasks

    work = demo_work("agl-bench-overhead-")
    inprocess_s = time_step(work.model, steps=steps)
    history = run_demo(
        [
            f"--tasks={write_tasks(work.folder / 'tasks.jsonl', 256, 0)}",
            f"--output_dir={work.folder / 'run'}",
            f"--model.path={work.model}",
            "--loop.mode=sync",
            f"--loop.max_steps={steps + 1}",
            "--loop.max_train_s=0",
            f"--loop.checkpoint_every={steps + 10}",
            "--val_tasks=null",  # the pipeline's training step only: no validation rounds
            "--loop.val_every=0",
        ]
    )
    rows = history[1:]  # the first step warms up
    keys = ["time/generating_s", "time/draining_s", "time/assembly_s", "time/training_s", "time/syncing_s"]
    mean = {key: statistics.mean(row[key] for row in rows) for key in keys + ["time/step_s"]}
    pipeline_s = mean["time/step_s"]
    print(f"in-process step (no pipeline):  {inprocess_s * 1000:8.1f} ms")
    print(f"pipeline step (sync):           {pipeline_s * 1000:8.1f} ms")
    print(f"ratio pipeline / in-process:    {pipeline_s / inprocess_s:8.1f}x   (target <= 10x)")
    print("where the pipeline's step goes:")
    print(f"  generating (runner, sidecar, engine, spans, receiver, store): {mean['time/generating_s'] * 1000:8.1f} ms")
    print(f"  draining the sidecar:                                         {mean['time/draining_s'] * 1000:8.1f} ms")
    print(f"  assembly (store -> samples):                                  {mean['time/assembly_s'] * 1000:8.1f} ms")
    train = mean["time/training_s"] - mean["time/assembly_s"]
    print(f"  training step (torch backend):                                {train * 1000:8.1f} ms")
    print(f"  weight sync into the engine:                                  {mean['time/syncing_s'] * 1000:8.1f} ms")
    print(f"(steps measured: {len(rows)}; work dir {work.folder})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
