"""What self-checking costs on the demo, and what it measures: the canary after every weight sync and
the per-token agreement metrics, as a share of the step they run in (same run, same steps).

    python bench/agreement.py [--quick] [--steps N] [--engine-dtype bfloat16]

The demo's config (collocated-async, 16 tasks x 8 episodes a step, the embedded engine in float32,
the torch backend). Per step the loop reports time/step_s, time/canary_s (the canary's probes: the
engine's prompt logprobs and two short generations, the trainer's forward over them) and the
backend perf/agreement_s (the agreement statistics and the trainer logprobs kept for the viewer);
the step's agreement/* figures are printed beside them. Target: the canary under 2% of a step.
With --engine-dtype bfloat16 the engine serves in bfloat16 against the float32 trainer: the drift
shows in agreement/lag0/* and the canary names it (verdict 1, numerics; tolerance 1e-3 here).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from _demo_run import bench_args, demo_work, run_demo

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    args = bench_args(
        __doc__, 4, 12, "fewer steps (about a minute)",
        lambda parser: parser.add_argument("--engine-dtype", default="float32", choices=["float32", "bfloat16"]),
    )  # fmt: skip
    steps = args.steps
    from examples.demo.task import write_tasks

    work = demo_work("agl-bench-agreement-")
    history = run_demo(
        [
            f"--tasks={write_tasks(work.folder / 'tasks.jsonl', 256, 0)}",
            f"--output_dir={work.folder / 'run'}",
            f"--model.path={work.model}",
            f"--loop.max_steps={steps + 1}",
            "--loop.max_train_s=0",
            f"--loop.checkpoint_every={steps + 10}",
            "--val_tasks=null",
            "--loop.val_every=0",
            f"--engine.options.dtype={args.engine_dtype}",
            *(["--diagnostics.canary.tolerance=1e-3"] if args.engine_dtype != "float32" else []),
        ]
    )
    rows = history[1:]  # the first step warms up

    def mean(key: str) -> float:
        return statistics.mean(row.get(key, 0.0) for row in rows)

    step_s, canary_s, agreement_s = mean("time/step_s"), mean("time/canary_s"), mean("perf/agreement_s")
    shares = sorted(row["time/canary_s"] / row["time/step_s"] for row in rows)
    print(f"steps measured: {len(rows)} (collocated-async demo, 128 rollouts a step, engine {args.engine_dtype})")
    print(f"step:                        {step_s * 1000:9.1f} ms   (mean)")
    print(f"canary after the sync:       {canary_s * 1000:9.1f} ms   {canary_s / step_s:7.2%} of a step (target < 2%)")
    print(f"  canary share per step:     median {statistics.median(shares):.2%}, min {shares[0]:.2%}, max {shares[-1]:.2%}")
    print(f"agreement metrics (backend): {agreement_s * 1000:9.1f} ms   {agreement_s / step_s:7.2%} of a step")
    print("agreement (mean over the steps):")
    for key in (
        "agreement/lag0/mean_abs_delta",
        "agreement/lag0/max_abs_delta",
        "agreement/lag0/k3",
        "agreement/lag0/frac_over",
        "agreement/stale/mean_abs_delta",
        "agreement/canary/mean_abs_delta",
        "agreement/canary/previous_mean_abs_delta",
    ):
        present = [row[key] for row in rows if key in row]
        if present:
            print(f"  {key:42s} {statistics.mean(present):.3g}   (over {len(present)} steps)")
    verdicts = sorted({int(row.get("agreement/canary/verdict", -1)) for row in rows})
    print(f"  canary verdicts (0 = agree): {verdicts}")
    print(f"  lag-0 tokens a step: {mean('agreement/lag0/tokens'):.0f}, stale: {mean('agreement/stale/tokens'):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
