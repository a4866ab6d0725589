"""Time to quality: which loop reaches a held-out target soonest on examples/hops, the task its warm
start cannot do. Each loop of bench/async_vs_sync.py (sync, drain, keep, partial with stale_policy
mask, their overrides reused from its LOOPS) trains the same warm start of each seed through the
whole pipeline, with the same simulated device time per engine step (`engine.options.device_step_ms`,
60 ms: a CPU alone leaves async nothing to overlap) and the same wall budget of training
(`loop.max_train_s`; validation rounds are not counted). A greedy held-out round every
`--val-every` steps and after the last gives the curve.

    python bench/time_to_quality.py --quick               # 1 seed, 45 s of RL a loop (about 10 minutes)
    python bench/time_to_quality.py --seeds 0 1 2 --budget-s 900 --val-every 10   # the full comparison
    python bench/time_to_quality.py --loops partial mask-only tis-only   # masking vs correcting (ARMS)
    python bench/time_to_quality.py --seeds 1 --loops partial --repeats 3   # each loop 3 times: medians

Per seed and loop: the training wall time to the first round at or above `--target` (a bound from
above: rounds come every --val-every steps), the held-out greedy reward of the last round (the
policy at the wall budget), trained rollouts/s, and tokens that entered the loss per second (less
those masked as too stale, dropped with their group at loop.max_span, or left out by a ratio mask:
a rollout whose stale tokens were masked is not a fully trained rollout), and the canary's share of
the wall: on the step's path (`canary`) and beside generation (`beside`, time
no step waits for). Ratios against sync,
measured in the same run; curves against wall time in OUT/time_to_quality.png, numbers in
OUT/time_to_quality.json.

Async runs are not reproducible step for step (which rollout lands in which step depends on timing),
and sync's own time to the target moved 2.5x between two runs of one seed, so one run a loop cannot
settle a ratio near the goal: `--repeats K` runs each loop K times on each seed and reports the
median time to the target (a run that never reached it counts as slower than any that did) and the
median final reward, with every run's time beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its bench siblings, run as a script or imported
from _demo_run import run_config  # noqa: E402
from async_vs_sync import DEVICE_STEP_MS, LOOPS, STALENESS  # noqa: E402  (the loops and device time, reused)

# The masking vs correcting ablation (issue #41), arms of `partial`: its stale tokens (older than
# loop.staleness) masked out of the loss and the rest reweighted by truncated importance weights
# (`partial`, both); masked but none reweighted (`mask-only`); none masked, every token reweighted
# (`tis-only`: the bound raised to 8 versions, which also lets launches run further ahead).
# `partial-wide`: partial with twice a batch of rollouts in flight (hops' batch is 64): an engine step's
# device time does not grow with its batch, so a loop that need not wait for its batch's tail can keep
# more rollouts decoding in each step (launched-but-untrained ones stay under loop.max_span batches; sync has
# only its batch to run).
_MODE, _SWITCH, _PARTIAL = LOOPS["partial"]
ARMS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "mask-only": (_MODE, _SWITCH, (*_PARTIAL, "--backend.algorithm.importance_scope=off")),
    "tis-only": (_MODE, _SWITCH, (*_PARTIAL, "--loop.staleness=8")),
    "partial-wide": (_MODE, _SWITCH, (*_PARTIAL, "--loop.concurrency=128")),
}
RUNS = {**LOOPS, **ARMS}
ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/hops/config.yaml"
sys.path.insert(0, str(ROOT))


def run_loop(name: str, prepared: Any, seed: int, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One loop on one seed's warm start, `args.repeats` times: its curve against training wall time
    and its throughput (the medians over repeats, each run's kept under "runs")."""
    runs = []
    for repeat in range(args.repeats):
        started = time.monotonic()
        summary = run_config(CONFIG, overrides(name, prepared, seed, out, args, repeat))
        seconds = time.monotonic() - started
        runs.append(measure(summary.history, summary.validation, args.target) | {"seconds": seconds})
    return runs[0] if len(runs) == 1 else combine(runs)


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one loop as one row: the median time to the target (a run that never reached it
    ranks after every run that did; the median is "not reached" when it falls on such a run), the
    median final reward, the mean of the rates; each run's own numbers under "runs"."""
    never = float("inf")
    times = [never if r["time_to_target_s"] is None else r["time_to_target_s"] for r in runs]
    middle = statistics.median(times)  # inf when the middle (or one of the two middle) never reached it
    finals = [r["final"] for r in runs if r["final"] is not None]
    rates = ("rollouts_per_s", "loss_tokens_per_s", "masked_share", "staleness_mean", "capped_frac",
             "canary_share", "canary_background_share")  # fmt: skip
    return {
        **runs[0],
        **{key: statistics.fmean(r[key] for r in runs) for key in rates},
        "steps": round(statistics.median(r["steps"] for r in runs)),
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "time_to_target_s": None if middle == never else middle,
        "final": statistics.median(finals) if finals else None,
        "runs": runs,
    }


def overrides(
    name: str, prepared: Any, seed: int, out: Path, args: argparse.Namespace, repeat: int = 0
) -> list[str]:
    """The hops config's overrides for one loop (or ablation arm) on one seed, in its own folder
    (`name`, then `name-r1`, `name-r2` for repeats): the arm's own last."""
    mode, switch, extra = RUNS[name]
    folder = out / f"seed-{seed}" / (name if repeat == 0 else f"{name}-r{repeat}")
    return [
        f"--engine.options.device_step_ms={args.device_step_ms}",
        f"--tasks={prepared.tasks}", f"--val_tasks={prepared.val_tasks}", f"--model.path={prepared.path}",
        f"--seed={seed}", f"--output_dir={folder}",
        f"--loop.mode={mode}", f"--loop.switch={switch}", f"--loop.staleness={STALENESS}",
        f"--loop.max_train_s={args.budget_s}", "--loop.max_steps=100000", "--loop.checkpoint_every=100000",
        f"--loop.val_every={args.val_every}", "--loop.val_sampled=0", *extra,
    ]  # fmt: skip


def measure(history: list[dict[str, float]], validation: list[dict[str, float]], target: float) -> dict[str, Any]:
    """The curve (training wall time at each validation round, its greedy reward) and the totals."""
    walls = [0.0]
    for row in history:
        walls.append(walls[-1] + row["time/step_s"])
    curve = [(walls[min(int(r["step"]), len(history))], r["val/reward"]) for r in validation if "val/reward" in r]
    reached = next((wall for wall, reward in curve if reward >= target), None)
    wall = walls[-1]

    def total(key: str) -> float:
        return sum(row.get(key, 0.0) for row in history)

    loss_tokens = total("perf/trained_tokens") - total("importance/ratio_masked_tokens")
    masked = total("staleness/masked_tokens")
    return {
        "steps": len(history),
        "wall_s": wall,
        "curve": curve,
        "time_to_target_s": reached,
        "final": curve[-1][1] if curve else None,
        "start": curve[0][1] if curve else None,
        "rollouts_per_s": total("rollouts/trained") / wall if wall else 0.0,
        "loss_tokens_per_s": loss_tokens / wall if wall else 0.0,
        "masked_share": masked / (masked + total("tokens/trained")) if masked else 0.0,
        "dropped_rollouts": total("rollouts/dropped_stale"),
        "staleness_mean": statistics.fmean([row.get("staleness/mean", 0.0) for row in history]) if history else 0.0,
        "capped_frac": statistics.fmean([row.get("importance/capped_frac", 0.0) for row in history]) if history else 0.0,
        "canary_share": total("time/canary_s") / wall if wall else 0.0,
        # the canary beside generation (keep; drain and partial with action warn): no step's time
        # (agreement/canary/background_s)
        "canary_background_share": total("agreement/canary/background_s") / wall if wall else 0.0,
    }


def ratio(value: float | None, reference: float | None) -> str:
    return f"{value / reference:.2f}x" if value and reference else "-"


def table(seed: int, results: dict[str, dict[str, Any]], target: float) -> str:
    sync = results.get("sync", {})
    width = max([8, *map(len, results)])  # the loop column fits partial-wide
    lines = [
        f"seed {seed} (held-out greedy target {target:g}):",
        f"{'loop':{width}} {'steps':>5} {'wall s':>7} {'to target s':>11} {'vs sync':>7} {'start':>6} {'final':>6}"
        f" {'rollouts/s':>10} {'vs sync':>7} {'loss tok/s':>10} {'vs sync':>7} {'masked':>6} {'lag':>5}"
        f" {'capped':>6} {'canary':>6} {'beside':>6}",
    ]
    for name, r in results.items():
        to_target = f"{r['time_to_target_s']:.1f}" if r["time_to_target_s"] is not None else "not reached"
        lines.append(
            f"{name:{width}} {r['steps']:5d} {r['wall_s']:7.1f} {to_target:>11} "
            f"{ratio(r['time_to_target_s'], sync.get('time_to_target_s')):>7} "
            f"{r['start'] if r['start'] is not None else float('nan'):6.3f} {r['final'] if r['final'] is not None else float('nan'):6.3f} "
            f"{r['rollouts_per_s']:10.2f} {ratio(r['rollouts_per_s'], sync.get('rollouts_per_s')):>7} "
            f"{r['loss_tokens_per_s']:10.0f} {ratio(r['loss_tokens_per_s'], sync.get('loss_tokens_per_s')):>7} "
            f"{r['masked_share']:6.1%} {r['staleness_mean']:5.2f} {r['capped_frac']:6.1%} {r['canary_share']:6.2%}"
            f" {r.get('canary_background_share', 0.0):6.2%}"
        )  # fmt: skip
    for name, r in results.items():
        if "runs" in r:  # repeats: the medians above, each run here
            each = ", ".join(
                f"{run['time_to_target_s']:.1f}" if run["time_to_target_s"] is not None else "not reached"
                for run in r["runs"]
            )
            finals = ", ".join(f"{run['final']:.3f}" if run["final"] is not None else "-" for run in r["runs"])
            lines.append(f"  {name} runs: to target s [{each}]; final [{finals}]")
    return "\n".join(lines)


def plot(all_results: dict[int, dict[str, dict[str, Any]]], target: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted(all_results)
    figure, axes = plt.subplots(1, len(seeds), figsize=(6 * len(seeds), 4.2), dpi=100, squeeze=False)
    for axis, seed in zip(axes[0], seeds):
        for index, (name, r) in enumerate(all_results[seed].items()):
            for repeat, run in enumerate(r.get("runs", [r])):
                if run["curve"]:
                    axis.plot(
                        *zip(*run["curve"]), "o-", color=f"C{index}", markersize=3,
                        label=name if repeat == 0 else None, alpha=1.0 if repeat == 0 else 0.5,
                    )  # fmt: skip
        axis.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:g}")
        axis.set(title=f"hops seed {seed}: held-out greedy reward", xlabel="training wall time (s)", ylabel="reward")
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 seed, 45 s of RL a loop, a round every 5 steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (--quick: 0)")
    parser.add_argument(
        "--loops", nargs="+", choices=tuple(RUNS), default=list(LOOPS),
        help="loops to run (default: the four; mask-only and tis-only are the ablation's arms beside partial,"
        " partial-wide partial with twice the rollouts in flight)",
    )  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=None, help="seconds of RL a loop (default 900; --quick 45)")
    parser.add_argument("--val-every", type=int, default=None, help="steps between rounds (default 10; --quick 5)")
    parser.add_argument("--target", type=float, default=None, help="held-out greedy target (default 0.5; --quick 0.25)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each loop on each seed (medians reported)")
    parser.add_argument("--device-step-ms", type=float, default=DEVICE_STEP_MS)
    parser.add_argument("--out", type=Path, default=None, help="where runs, JSON and PNG go (default: a temp folder)")
    args = parser.parse_args()
    quick = args.quick
    args.seeds = args.seeds or ([0] if quick else [0, 1, 2])
    args.budget_s = args.budget_s or (45.0 if quick else 900.0)
    args.val_every = args.val_every or (5 if quick else 10)
    args.target = args.target if args.target is not None else (0.25 if quick else 0.5)
    bad = [value for value in (args.budget_s, args.val_every, args.repeats) if value <= 0]
    if bad or not 0 < args.target <= 1:
        parser.error("--budget-s, --val-every and --repeats must be positive and --target in (0, 1]")
    if "sync" not in args.loops:
        args.loops = ["sync", *args.loops]  # every ratio is against sync, measured in the same run
    out = args.out or Path(tempfile.mkdtemp(prefix="agl-bench-ttq-"))
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    from examples.hops.prepare import prepare_hops

    transformers.utils.logging.disable_progress_bar()
    print(
        f"hops, {args.device_step_ms:g} ms of device time a step, {args.budget_s:g} s of RL a loop, a greedy "
        f"held-out round every {args.val_every} steps, target {args.target:g}, {args.repeats} run(s) a loop;"
        f" work in {out}",
        flush=True,
    )
    all_results: dict[int, dict[str, dict[str, Any]]] = {}
    for seed in args.seeds:
        prepared = prepare_hops(out / f"seed-{seed}" / "prepared", seed=seed)
        all_results[seed] = {}
        for name in args.loops:
            all_results[seed][name] = run_loop(name, prepared, seed, out, args)
            (out / "time_to_quality.json").write_text(json.dumps(all_results, indent=1))
        print(table(seed, all_results[seed], args.target), flush=True)
    if len(args.seeds) > 1:
        for name in args.loops:
            rates = [
                all_results[s][name]["loss_tokens_per_s"] / all_results[s]["sync"]["loss_tokens_per_s"]
                for s in args.seeds
                if all_results[s]["sync"]["loss_tokens_per_s"]
            ]
            finals = [all_results[s][name]["final"] for s in args.seeds if all_results[s][name]["final"] is not None]
            reached = sum(all_results[s][name]["time_to_target_s"] is not None for s in args.seeds)
            print(
                f"{name:8} over {len(args.seeds)} seeds: final greedy mean {statistics.fmean(finals):.3f}"
                f" (min {min(finals):.3f}, max {max(finals):.3f}); target reached by {reached}; loss tokens/s"
                f" {statistics.fmean(rates):.2f}x sync"
            )
    print(f"curves {plot(all_results, args.target, out / 'time_to_quality.png')}; numbers {out / 'time_to_quality.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
