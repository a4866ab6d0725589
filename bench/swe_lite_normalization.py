"""Rollout- vs sample- vs token-level normalization on swe-lite (examples/swe_lite): mini-swe-agent
fixing bugs in its own harness, where failing rollouts make more model calls than passing ones, as in
the seed's coding runs (seed 0's RL run, runs/swe_lite_s0g/rl/rollouts.db: 3 to 6 calls a rollout,
5.08 on average when it passed, 5.81 when it failed; mini-swe-agent's turns merge into 1.19 samples a
rollout). bench/normalization.py asks the same question on hops, in-process, where a rollout makes 1 to
16 samples; here every run is the real pipeline: `agl train` and `agl eval`.

Each (mode, seed) trains one warm start (`--run R`, built by `python -m examples.swe_lite.prepare --out
R`) with examples/swe_lite/config.yaml, the mode's overrides, `--seed S` (the task order and the
trainer's torch seed) and `--train-s` seconds of RL (loop.max_train_s), then `agl eval` of its last
checkpoint on R's val set, greedy (and mean@4 at the config's train temperature with --sampled).
`--steps N` gives every run N steps instead (loop.max_steps, no time limit): the sample level's
per-call rows forward each call's whole context, about 3x the tokens of a merged step (92,674 against
30,007 in a first step of seed 0's warm start), so in equal time it makes fewer steps; equal steps
compare the normalizations alone, equal time what a user pays.

  rollout  agl's default: GRPO per rollout over a call-merged sample per thread, `rollout-mean`
  sample   as Agent Lightning trains: every call its own row (`assembly.merge_calls false`), its own
           advantage unit (`advantage_unit sample`: GRPO over the rows of a task, each with its
           rollout's reward) and `seq-mean-token-mean`: a rollout weighs by its number of calls
  token    GRPO per rollout, `token-mean`: a rollout weighs by its generated tokens
  merged   (not run by default) agl's samples as Agent Lightning's units: per-sample advantages and
           seq-mean-token-mean over the call-merged samples

Runs that finished (their eval's results.json) are read, not rerun, so the study can be built up
over several sittings; a run cut short is started again. Printed: per mode, the held-out reward of
the warm start and after RL (mean over seeds), training steps, entropy drift (the mean token entropy
of the last 5 steps minus the first 5), samples and calls a rollout; then each mode against rollout,
paired by seed, with a 95% t-interval. A held-out attempt that failed (mini-swe-agent out of steps)
scores 0 and is counted and warned about: the warm start's and trained policies fail none, but two
`agl eval` runs at once once wiped each other's repository copies (23 and 40 of 64 failed; the
copies are keyed by AGL_RUN_ID since).
OUT/swe_lite_normalization.{json,png}.

    python bench/swe_lite_normalization.py --seeds 0 1 2 3 4                # 15 runs of 30 minutes
    python bench/swe_lite_normalization.py --seeds 0 --train-s 600          # 3 runs of 10 minutes
    python bench/swe_lite_normalization.py --steps 20 --out runs/bench-swln-20   # equal steps
    python bench/swe_lite_normalization.py --report                          # what has finished
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its bench siblings, run as a script or imported
from normalization import drift, paired_interval, save_figure  # noqa: E402  (as the hops study does)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/swe_lite/config.yaml"
_UNIT, _AGG = "--backend.algorithm.advantage_unit", "--backend.algorithm.loss_agg_mode"
MODES: dict[str, list[str]] = {  # name -> `agl train` overrides
    "rollout": [f"{_UNIT}=rollout", f"{_AGG}=rollout-mean"],
    "sample": ["--assembly.merge_calls=false", f"{_UNIT}=sample", f"{_AGG}=seq-mean-token-mean"],
    "token": [f"{_UNIT}=rollout", f"{_AGG}=token-mean"],
    "merged": [f"{_UNIT}=sample", f"{_AGG}=seq-mean-token-mean"],
}
DEFAULT_MODES = ("rollout", "sample", "token")
ENTROPY_WINDOW = 5  # steps at each end of a run for its entropy drift


@dataclass
class Run:
    """One finished (mode, seed): its steps' metrics and its held-out results."""

    mode: str
    seed: int
    reward: list[float] = field(default_factory=list)  # training reward per step
    entropy: list[float] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)  # samples per rollout, per step
    calls: list[float] = field(default_factory=list)  # model calls per rollout, per step
    val_greedy: float = math.nan
    val_sampled: float = math.nan
    failed: int = 0  # held-out attempts that failed (scored 0)

    @property
    def entropy_drift(self) -> float:
        return drift(self.entropy, ENTROPY_WINDOW) if self.entropy else math.nan


def budget_flags(train_s: float, steps: int | None) -> list[str]:
    """A run's budget: `steps` training steps (no time limit), or `train_s` seconds of training."""
    if steps is not None:
        return ["--loop.max_steps", str(steps), "--loop.max_train_s", "0"]
    return ["--loop.max_train_s", str(train_s)]


def train_command(run: Path, mode: str, seed: int, budget: list[str], out: Path) -> list[str]:
    return [
        "agl", "train", str(CONFIG), "--quiet",
        "--tasks", str(run / "train/tasks.jsonl"), "--val_tasks", str(run / "val/tasks.jsonl"),
        "--model.path", str(run / "model-warm"), "--viewer.enabled", "false",
        "--seed", str(seed), *budget, "--output_dir", str(out), *MODES[mode],
    ]  # fmt: skip


def eval_command(run: Path, model: list[str], k: int, out: Path) -> list[str]:
    """Greedy (k 1, val sampling) or mean@k at the config's train temperature, on R's val set."""
    return [
        "agl", "eval", str(CONFIG),
        "--tasks", str(run / "train/tasks.jsonl"), "--val_tasks", str(run / "val/tasks.jsonl"),
        "--viewer.enabled", "false", *model,
        "--eval.k", str(k), "--eval.mode", "val" if k == 1 else "train", "--eval.output_dir", str(out),
    ]  # fmt: skip


def mean_reward(results: Path) -> tuple[float, int]:
    """An evaluation's mean@k and how many of its attempts failed."""
    summary = json.loads(results.read_text())["summary"]
    return float(summary[f"mean@{int(summary['k'])}"]), int(summary.get("failed", 0))


def read_run(mode: str, seed: int, folder: Path) -> Run:
    """A finished run's curves from its metrics.jsonl and its eval results."""
    run = Run(mode, seed)
    for line in (folder / "rl/metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rollouts = row.get("assembly/rollouts") or math.nan
        run.reward.append(float(row["reward/mean"]))
        run.entropy.append(float(row["actor/entropy"]))
        run.samples.append(row.get("assembly/samples", math.nan) / rollouts)
        run.calls.append(row.get("assembly/calls", math.nan) / rollouts)
    run.val_greedy, run.failed = mean_reward(folder / "eval-val/results.json")
    sampled = folder / "eval-val-k4/results.json"
    if sampled.exists():
        run.val_sampled, failed = mean_reward(sampled)
        run.failed += failed
    return run


def execute(command: list[str], log: Path) -> None:
    print("$", " ".join(command), f"> {log}", flush=True)
    with log.open("a") as out:
        try:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, check=False)
        except FileNotFoundError:
            raise SystemExit(f"{command[0]}: not on PATH (fix: activate the venv, . .venv/bin/activate)") from None
    if done.returncode != 0:
        raise SystemExit(f"failed (exit {done.returncode}): {' '.join(command)}; its output: {log}")


def run_one(run: Path, mode: str, seed: int, args: argparse.Namespace) -> Path:
    """Train and evaluate (mode, seed) unless its results are there; a run cut short starts over."""
    folder = args.out / f"{mode}-s{seed}"
    trained, budget = folder / "rl/trained.done", budget_flags(args.train_s, args.steps)
    if trained.exists() and trained.read_text().split() != budget:
        raise SystemExit(
            f"{folder} was trained with {trained.read_text().strip()}, not {' '.join(budget)}: "
            "give another --out (a study compares runs of one budget)"
        )
    if not trained.exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        execute(train_command(run, mode, seed, budget, folder / "rl"), folder / "train.log")
        trained.write_text(" ".join(budget) + "\n")
    checkpoint = ["--checkpoint", str(folder / "rl")]
    if not (folder / "eval-val/results.json").exists():
        execute(eval_command(run, checkpoint, 1, folder / "eval-val"), folder / "eval.log")
    if args.sampled and not (folder / "eval-val-k4/results.json").exists():
        execute(eval_command(run, checkpoint, 4, folder / "eval-val-k4"), folder / "eval.log")
    return folder


def warm_start(run: Path, args: argparse.Namespace) -> dict[str, float]:
    """The warm start's held-out rewards (evaluated once, shared by every mode and seed)."""
    folder, model = args.out / "warm", ["--model.path", str(run / "model-warm")]
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for k, name in [(1, "eval-val"), *([(4, "eval-val-k4")] if args.sampled else [])]:
        if not (folder / name / "results.json").exists() and not args.report:
            execute(eval_command(run, model, k, folder / name), folder / "eval.log")
        if (folder / name / "results.json").exists():
            out["greedy" if k == 1 else "sampled"], failed = mean_reward(folder / name / "results.json")
            out["failed"] = out.get("failed", 0) + failed
    return out


def finished(out: Path, modes: list[str], seeds: list[int]) -> list[Run]:
    return [
        read_run(mode, seed, out / f"{mode}-s{seed}")
        for mode in modes
        for seed in seeds
        if (out / f"{mode}-s{seed}/eval-val/results.json").exists()
    ]


def _mean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.fmean(kept) if kept else math.nan


def table(runs: list[Run]) -> list[dict[str, Any]]:
    rows = []
    for mode in dict.fromkeys(r.mode for r in runs):
        mine = [r for r in runs if r.mode == mode]
        rows.append({
            "mode": mode, "seeds": [r.seed for r in mine],
            "val_greedy": _mean([r.val_greedy for r in mine]),
            "val_sampled": _mean([r.val_sampled for r in mine]),
            "steps": _mean([float(len(r.reward)) for r in mine]),
            "entropy_drift": _mean([r.entropy_drift for r in mine]),
            "samples_per_rollout": _mean([_mean(r.samples) for r in mine]),
            "calls_per_rollout": _mean([_mean(r.calls) for r in mine]),
            "failed": sum(r.failed for r in mine),
        })  # fmt: skip
    return rows


def comparisons(runs: list[Run]) -> list[dict[str, Any]]:
    """Each mode against rollout on the same seeds: held-out greedy and sampled, entropy drift."""
    reference = {r.seed: r for r in runs if r.mode == "rollout"}
    out = []
    for mode in dict.fromkeys(r.mode for r in runs if r.mode != "rollout"):
        pairs = [(r, reference[r.seed]) for r in runs if r.mode == mode and r.seed in reference]
        for metric in ("val_greedy", "val_sampled", "entropy_drift"):
            differences = [getattr(r, metric) - getattr(ref, metric) for r, ref in pairs]
            differences = [d for d in differences if not math.isnan(d)]
            if not differences:
                continue
            mean, low, high = paired_interval(differences)
            out.append({"mode": mode, "metric": metric, "seeds": len(differences), "difference": mean,
                        "low": low, "high": high})  # fmt: skip
    return out


def plot(runs: list[Run], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(MODES, ["tab:blue", "tab:red", "tab:green", "tab:purple"]))
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2), dpi=100)
    for run in runs:
        label = run.mode if run.seed == min(r.seed for r in runs if r.mode == run.mode) else None
        steps = range(1, len(run.reward) + 1)
        axes[0].plot(steps, run.reward, color=colors[run.mode], alpha=0.6, label=label)
        axes[1].plot(steps, run.entropy, color=colors[run.mode], alpha=0.6, label=label)
        axes[2].plot([list(MODES).index(run.mode)], [run.val_greedy], "o", color=colors[run.mode],
                     label=label)  # fmt: skip
    axes[0].set(title="training reward", xlabel="step", ylabel="mean reward of the step's rollouts")
    axes[1].set(title="policy entropy on trained tokens", xlabel="step", ylabel="nats")
    axes[2].set(title="held-out greedy after RL (one point a seed)", ylabel="pass@1",
                xticks=range(len(MODES)), xticklabels=list(MODES))  # fmt: skip
    return save_figure(figure, axes, path)


def report(runs: list[Run], warm: dict[str, float], args: argparse.Namespace) -> None:
    budget = f"{args.steps} steps" if args.steps is not None else f"{args.train_s:g} s of RL"
    print(f"\nnormalization on swe-lite ({args.run}, {budget} a run; held-out: its val set)")
    greedy, sampled = warm.get("greedy", math.nan), warm.get("sampled", math.nan)
    print(f"warm start: greedy {greedy:.4f}, mean@4 {sampled:.4f}, failed {warm.get('failed', 0)}")
    print(f"{'mode':8} {'seeds':>5} {'greedy':>7} {'mean@4':>7} {'steps':>6} {'entropy drift':>13} "
          f"{'samples/r':>9} {'calls/r':>7} {'failed':>6}")  # fmt: skip
    for row in table(runs):
        print(f"{row['mode']:8} {len(row['seeds']):5d} {row['val_greedy']:7.4f} {row['val_sampled']:7.4f} "
              f"{row['steps']:6.1f} {row['entropy_drift']:+13.3f} {row['samples_per_rollout']:9.2f} "
              f"{row['calls_per_rollout']:7.2f} {row['failed']:6d}")  # fmt: skip
    for run in runs:
        if run.failed:  # a failed attempt scores 0: the number is not the policy's
            print(f"warning: {run.mode}-s{run.seed}: {run.failed} held-out attempts failed; "
                  f"evaluate it again alone (remove {run.mode}-s{run.seed}/eval-val*)")  # fmt: skip
    for row in comparisons(runs):
        print(f"{row['mode']} - rollout, {row['metric']}: {row['difference']:+.4f} "
              f"(95% CI {row['low']:+.4f} .. {row['high']:+.4f}, {row['seeds']} seeds paired)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", type=Path, default=Path("runs/swe_lite_s0g"),
                        help="a prepared swe-lite folder (model-warm, train/ and val/ tasks)")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help="comma-separated, of " + ", ".join(MODES))  # fmt: skip
    parser.add_argument("--train-s", type=float, default=1800.0,
                        help="seconds of RL a run (loop.max_train_s)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps a run instead (loop.max_steps, no time limit)")  # fmt: skip
    parser.add_argument("--sampled", action="store_true",
                        help="also mean@4 at the config's train temperature")  # fmt: skip
    parser.add_argument("--report", action="store_true", help="run nothing: report the runs that finished")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-swe-lite-normalization"))
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"--modes: unknown {unknown} (choose from {', '.join(MODES)})")
    if not args.train_s > 0:
        parser.error(f"--train-s {args.train_s:g}: give a positive number of seconds")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps}: give 1 or more")
    needed = ("model-warm/config.json", "train/tasks.jsonl", "val/tasks.jsonl")
    missing = [p for p in needed if not (args.run / p).exists()]
    if missing and not args.report:
        parser.error(
            f"--run {args.run} lacks {missing}: build it with python -m examples.swe_lite.prepare --out {args.run}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    warm = warm_start(args.run, args)
    if not args.report:
        for seed in args.seeds:  # seed by seed: a partial study already has whole pairs
            for mode in modes:
                run_one(args.run, mode, seed, args)
    runs = finished(args.out, modes, args.seeds)
    if not runs:
        print(f"no finished run under {args.out}")
        return 0
    report(runs, warm, args)
    data = {"run": str(args.run), "budget": budget_flags(args.train_s, args.steps), "warm": warm,
            "table": table(runs), "comparisons": comparisons(runs), "runs": [vars(r) for r in runs]}  # fmt: skip
    (args.out / "swe_lite_normalization.json").write_text(json.dumps(data, indent=1))
    picture = plot(runs, args.out / "swe_lite_normalization.png")
    print(f"wrote {args.out / 'swe_lite_normalization.json'}, {picture}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
