"""A whole RL run on one GPU: examples/hops through the loop with the embedded engine on CUDA and the
torch backend in bfloat16 (examples/hops/config-gpu.yaml), then what it did.

It prepares the hops model (the one-hop warm start, on the CPU), runs `agl train` with the GPU
config for `--budget-s` seconds of training (loop.max_train_s; at most `--max-steps` steps), and
reads the run's metrics.jsonl:

  steps, the median step and its split (time/generating_s, time/training_s, time/syncing_s, the rest
  draining, assembly and checkpoints), the backend's own step (perf/step_s) and tokens/s;
  the learning curve: training reward (reward/mean) by tenths of the run, and the held-out rounds
  (val/reward: greedy; val/sampled/reward: mean@2 at temperature 1).

The CPU run of the same task (config.yaml, 2 cores: docs/results.md, "Hops") is the reference: ~240
steps in 15 minutes, held-out greedy 0.125 -> 0.665 for seed 0.

    python bench/gpu_rl_run.py                              # cuda, 150 s of training (gpu_check.sh: 60 s)
    python bench/gpu_rl_run.py --device cpu --budget-s 20 --max-steps 3   # the same run, tiny, on the CPU
    python bench/gpu_rl_run.py ... --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "hops" / "config-gpu.yaml"
sys.path.insert(0, str(ROOT))


def agl_command() -> list[str]:
    """`agl` beside this interpreter (a venv), else on PATH, else this interpreter running its main
    (a bare CUDA image with agl on PYTHONPATH: scripts/gpu_site.sh)."""
    beside = Path(sys.executable).parent / "agl"
    if beside.exists():
        return [str(beside)]
    if found := shutil.which("agl"):
        return [found]
    return [sys.executable, "-c", "import sys; from agl_trainer.cli import main; sys.exit(main())"]


def train(args: argparse.Namespace, out: Path) -> tuple[Path, float, float]:
    """Prepare and run; returns (the run's directory, prepare seconds, agl train's wall seconds)."""
    from examples.hops.prepare import prepare_hops

    started = time.monotonic()
    prepared = prepare_hops(out / "prep", seed=args.seed)
    prepare_s = time.monotonic() - started
    run_dir = out / "run"
    command = [
        *agl_command(), "train", str(CONFIG), f"--output_dir={run_dir}",
        f"--tasks={prepared.tasks}", f"--val_tasks={prepared.val_tasks}", f"--model.path={prepared.path}",
        f"--seed={args.seed}", f"--loop.max_train_s={args.budget_s}", f"--loop.max_steps={args.max_steps}",
    ]  # fmt: skip
    if args.device == "cpu":
        command += ["--backend.device=cpu", "--engine.options.device=cpu", "--harness.workers=2"]
    print(f"gpu_rl_run: {' '.join(command[1:])}", flush=True)
    started = time.monotonic()
    with open(out / "train.log", "w") as log:
        status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False, cwd=ROOT).returncode
    wall = time.monotonic() - started
    if status != 0:
        tail = (out / "train.log").read_text()[-3000:]
        raise SystemExit(f"gpu_rl_run: agl train exited with {status}; the end of {out / 'train.log'}:\n{tail}")
    return run_dir, prepare_s, wall


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Step time, its split and the learning curve from a run's metrics rows."""
    steps = [row for row in rows if "time/step_s" in row]
    if not steps:
        raise SystemExit("gpu_rl_run: the run wrote no step metrics (see train.log)")

    def median(key: str) -> float:
        values = [float(row[key]) for row in steps if key in row]
        return statistics.median(values) if values else 0.0

    def total(key: str) -> float:
        return sum(float(row.get(key, 0.0)) for row in steps)

    tenths = []
    for part in range(10):
        chunk = steps[part * len(steps) // 10 : (part + 1) * len(steps) // 10]
        rewards = [float(row["reward/mean"]) for row in chunk if "reward/mean" in row]
        if rewards:
            tenths.append(round(statistics.fmean(rewards), 3))
    return {
        "steps": len(steps),
        "step_s_median": median("time/step_s"),
        "generating_s_median": median("time/generating_s"),
        "training_s_median": median("time/training_s"),
        "syncing_s_median": median("time/syncing_s"),
        "backend_step_s_median": median("perf/step_s"),
        "tokens_per_s_median": median("perf/tokens_per_s"),
        "seconds": {key: total(f"time/{key}_s") for key in ("step", "generating", "training", "syncing")},
        "reward_by_tenth": tenths,
        "val_greedy": [(int(row["step"]), float(row["val/reward"])) for row in rows if "val/reward" in row],
        "val_sampled": [
            (int(row["step"]), float(row["val/sampled/reward"])) for row in rows if "val/sampled/reward" in row
        ],
    }


def report(summary: dict[str, Any], device: str) -> None:
    seconds = summary["seconds"]
    share = {key: seconds[key] / max(seconds["step"], 1e-9) for key in ("generating", "training", "syncing")}
    print(
        f"gpu_rl_run ({device}): {summary['steps']} steps; median step {summary['step_s_median']:.3f} s = "
        f"generating {summary['generating_s_median']:.3f} + training {summary['training_s_median']:.3f} + "
        f"syncing {summary['syncing_s_median']:.3f} s (+ draining, assembly, checkpoints); whole run: "
        f"generating {share['generating']:.0%}, training {share['training']:.0%}, syncing {share['syncing']:.0%}"
    )
    print(
        f"  backend step (perf/step_s) {summary['backend_step_s_median']:.3f} s, "
        f"{summary['tokens_per_s_median']:.0f} tokens/s"
    )
    print(f"  training reward by tenths of the run: {summary['reward_by_tenth']}")
    print(f"  held-out greedy (step, reward): {summary['val_greedy']}")
    print(f"  held-out sampled mean@2 (step, reward): {summary['val_sampled']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--budget-s", type=float, default=150.0, help="seconds of training (loop.max_train_s)")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-rl"))
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    if args.budget_s <= 0 or args.max_steps < 1:
        parser.error("--budget-s must be > 0 and --max-steps >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_rl_run: --device cuda, but torch sees no CUDA device (use --device cpu here)", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir, prepare_s, wall = train(args, args.out)
    from agl_trainer.metrics import read_jsonl

    summary = summarize(read_jsonl(run_dir / "metrics.jsonl"))
    summary.update(device=args.device, prepare_s=prepare_s, train_wall_s=wall, budget_s=args.budget_s)
    print(f"gpu_rl_run: prepared in {prepare_s:.1f} s; agl train took {wall:.1f} s (training budget {args.budget_s:g} s)")
    report(summary, args.device)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
