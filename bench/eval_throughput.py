"""`agl eval`'s throughput against the training loop's generation rate, on the demo, in one run.

Both go through the same parts (runner workers, the demo harness, agl-sidecar, embedded engine,
receiver, store) from the same warm-started demo model at the same concurrency:
  - training: `loop.mode: sync` steps of BATCH rollouts (generation and training do not overlap,
    so the generation rate is rollouts / time/generating_s, the loop's own clock);
  - evaluation: `agl eval` of TASKS x K = BATCH attempts (rollouts / the attempts' wall time,
    results.json's rollouts_per_s: launch to the last attempt's data in the store, as the loop's time/generating_s ends when its batch's data is; start-up and scoring apart).

    python bench/eval_throughput.py [--quick] [--steps N]

Prints both rates (rollouts/s) and eval / train, against all steps, the first step (a cold wave:
runner workers import the harness, the engine's first batches, as in an eval's single wave) and the
later, warm steps. Evaluation adds per call only a seed computed in the sidecar (the request
re-encoded with it), and per run one wait for the sidecar's spans to be delivered.
"""

from __future__ import annotations

import sys
from pathlib import Path

from _demo_run import bench_args, demo_work, run_demo

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    args = bench_args(__doc__, quick_steps=2, steps=4, quick_help="2 steps of 64 rollouts, 8 tasks x 8 attempts")
    batch, k = (64, 8) if args.quick else (128, 8)
    tasks_n = batch // k
    work = demo_work("agl-bench-eval-")
    from examples.demo.run import write_val_tasks
    from examples.demo.task import make_tasks, write_tasks

    tasks = write_tasks(work.folder / "tasks.jsonl", 256, 0)
    val = write_val_tasks(work.folder / "val.jsonl", tasks_n, 0, exclude=make_tasks(256, 0))
    common = [
        f"--tasks={tasks}", f"--val_tasks={val}", f"--model.path={work.model}", f"--loop.concurrency={batch}",
        "--diagnostics.canary.enabled=false", "--viewer.enabled=false",
    ]  # fmt: skip
    history = run_demo([
        *common, f"--output_dir={work.folder / 'train'}", "--loop.mode=sync", f"--loop.batch_rollouts={batch}",
        "--loop.group_size=8", f"--loop.max_steps={args.steps}", "--loop.max_train_s=0", "--loop.val_every=0",
        "--loop.checkpoint_every=1000",
    ])  # fmt: skip
    per_step = [
        (row.get("rollouts/trained", 0.0) + row.get("rollouts/failed", 0.0), row["time/generating_s"]) for row in history
    ]
    rollouts = sum(n for n, _ in per_step)
    generating = sum(s for _, s in per_step)
    train_rate = rollouts / generating
    first_rate = per_step[0][0] / per_step[0][1]  # the first wave: runner workers and engine cold, as an eval's one wave
    warm = per_step[1:] or per_step
    warm_rate = sum(n for n, _ in warm) / sum(s for _, s in warm)

    from agl_trainer.config import load_config
    from agl_trainer.run.evaluation import run_eval_sync

    config = load_config(
        ROOT / "examples/demo/config.yaml",
        [*common, f"--eval.output_dir={work.folder / 'eval'}", f"--eval.k={k}", "--loop.val_every=0"],
        check_paths=False,
    )
    result = run_eval_sync(config, quiet=True)
    eval_rate = result.summary["rollouts_per_s"]
    print(f"training generation: {rollouts:.0f} rollouts in {generating:.2f} s of generating = {train_rate:.2f} rollouts/s")
    print(
        f"agl eval:            {result.rollouts} rollouts in {result.summary['rollout_seconds']:.2f} s = "
        f"{eval_rate:.2f} rollouts/s (start-up {result.summary['seconds'] - result.summary['rollout_seconds']:.1f} s apart)"
    )
    print(f"  first step (cold, one wave like an eval): {first_rate:.2f} rollouts/s; later steps (warm): {warm_rate:.2f}")
    print(f"eval / training generation rate: {eval_rate / train_rate:.2f}x (all steps), {eval_rate / first_rate:.2f}x "
          f"(first step), {eval_rate / warm_rate:.2f}x (later steps)")


if __name__ == "__main__":
    main()
