"""The hops example for several seeds: prepare each seed's warm start and tasks, train it with
`agl train examples/hops/config.yaml` (the whole pipeline, in its own process; its validation rounds
run on the val split), then measure the test-split reward of the warm start and of the final
weights in-process (greedy, and sampled mean@4), and plot every seed's curves together. The test
split is read here only, after training: choose settings on the val split (the pipeline rounds).

    python -m examples.hops.run                       # seeds 0 1 2, 15 minutes of RL each
    python -m examples.hops.run --seeds 0 --budget-s 120 --out runs/hops-smoke
    python -m examples.hops.run --seeds 2 --set backend.lr=1e-3 --out runs/hops-lr   # a config override
    python -m examples.hops.run --combine runs/hops-a runs/hops-b --out runs/hops    # seeds run apart

Writes OUT/seed-N/ (model, tasks, the run: metrics.jsonl, reward.png), OUT/hops.json, OUT/hops.png.
Run from the repository root.
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

CONFIG = Path("examples/hops/config.yaml")


def load_average() -> float:
    return os.getloadavg()[0]


def train_seed(out: Path, seed: int, budget_s: float, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agl_trainer.metrics import read_jsonl
    from examples.hops.play import evaluate
    from examples.hops.prepare import EVAL_K, prepare_hops
    from examples.hops.tokens import HopsTokens

    work = out / f"seed-{seed}"
    if work.exists():
        shutil.rmtree(work)
    prepared = prepare_hops(work, seed=seed)
    run_dir = work / "run"
    command = [
        str(Path(sys.executable).parent / "agl"), "train", str(CONFIG), f"--output_dir={run_dir}",
        f"--tasks={prepared.tasks}", f"--val_tasks={prepared.val_tasks}", f"--model.path={prepared.path}",
        f"--seed={seed}", f"--loop.max_train_s={budget_s}", *(f"--{item}" for item in overrides),
    ]  # fmt: skip
    print(f"hops seed {seed}: {' '.join(command[1:])}", flush=True)
    loads, started = [load_average()], time.monotonic()
    with open(work / "train.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        while process.poll() is None:
            time.sleep(15)
            loads.append(load_average())
    seconds = time.monotonic() - started
    if process.returncode != 0:
        raise SystemExit(
            f"hops seed {seed}: agl train exited with {process.returncode}; see {work / 'train.log'}"
        )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    val = [(row["step"], row["val/reward"]) for row in rows if "val/reward" in row]
    sampled = [(row["step"], row["val/sampled/reward"]) for row in rows if "val/sampled/reward" in row]
    train = [(row["step"], row["reward/mean"]) for row in rows if "reward/mean" in row]
    final_model = (
        run_dir
        / "checkpoints"
        / (run_dir / "checkpoints" / "latest").read_text().strip()
        / "backend"
        / "model"
    )
    tokens = HopsTokens(AutoTokenizer.from_pretrained(prepared.path))
    test = [json.loads(line) for line in prepared.test_tasks.read_text().splitlines()]
    final = evaluate(
        AutoModelForCausalLM.from_pretrained(final_model, dtype=torch.float32),
        tokens,
        test,
        k=EVAL_K,
        seed=seed,
    )
    return {
        "seed": seed,
        "steps": len(train),
        "rl_seconds": seconds,
        "load_average": {"mean": statistics.fmean(loads), "max": max(loads)},
        "held_out": "test split for warm/final, val split for val/val_sampled (disjoint from training)",
        "warm": prepared.warm,  # in-process, before RL, test split: greedy and sampled mean@4
        "final": final,  # in-process, the last checkpoint, test split
        "final_checkpoint": str(final_model),
        "val": val,  # through the pipeline, val split: greedy rounds
        "val_sampled": sampled,  # through the pipeline, val split: mean@2 rounds
        "train": train,
    }


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.2), dpi=100)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    for color, result in zip(colors, results):
        seed = result["seed"]
        axes[0].plot(*zip(*result["val"]), "o-", color=color, label=f"seed {seed}: greedy", markersize=3)
        if result["val_sampled"]:
            axes[0].plot(
                *zip(*result["val_sampled"]),
                "s--",
                color=color,
                alpha=0.6,
                label=f"seed {seed}: sampled mean@2",
                markersize=3,
            )
        axes[1].plot(*zip(*result["train"]), color=color, alpha=0.7, label=f"seed {seed}")
    axes[0].set(
        title="val-split reward (64 chains, through the pipeline)", xlabel="training step", ylabel="reward"
    )
    axes[1].set(
        title="training reward (mean of the step's rollouts)", xlabel="training step", ylabel="reward"
    )
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.hops.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--budget-s", type=float, default=900.0, help="seconds of RL per seed (loop.max_train_s)"
    )
    parser.add_argument("--out", default="runs/hops")
    parser.add_argument(
        "--combine", nargs="+", metavar="DIR", default=None,
        help="train nothing: merge the hops.json of runs made apart (e.g. one seed each) into OUT's "
        "numbers and plot",
    )  # fmt: skip
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="a config override for every seed's `agl train` (e.g. backend.lr=1e-3); repeatable",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if bad := [item for item in args.overrides if "=" not in item or item.startswith("-")]:
        parser.error(f"--set takes KEY=VALUE (a config key such as backend.lr=1e-3), got {bad[0]!r}")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.combine:
        results = combined(parser, [Path(d) for d in args.combine])
        print("\n".join(describe(result) for result in results))
        return summarize(results, out)
    results = []
    for seed in args.seeds:
        result = train_seed(out, seed, args.budget_s, tuple(args.overrides))
        results.append(result)
        (out / "hops.json").write_text(json.dumps(results, indent=1))
        print(describe(result), flush=True)
    return summarize(results, out)


def describe(result: dict[str, Any]) -> str:
    return (
        f"hops seed {result['seed']}: {result['steps']} steps in {result['rl_seconds']:.0f} s (load average "
        f"{result['load_average']['mean']:.1f}, max {result['load_average']['max']:.1f}); test split "
        f"greedy {result['warm']['greedy']:.3f} -> {result['final']['greedy']:.3f}, sampled mean@4 "
        f"{result['warm']['sampled']:.3f} -> {result['final']['sampled']:.3f}; val split (pipeline "
        f"rounds) greedy {result['val'][0][1]:.3f} -> {result['val'][-1][1]:.3f}"
    )


def combined(parser: argparse.ArgumentParser, folders: list[Path]) -> list[dict[str, Any]]:
    results: dict[int, dict[str, Any]] = {}
    for folder in folders:
        numbers = folder / "hops.json"
        if not numbers.is_file():
            parser.error(
                f"--combine: {numbers} does not exist (fix: a folder a `python -m examples.hops.run` wrote)"
            )
        for result in json.loads(numbers.read_text()):
            if result["seed"] in results:
                parser.error(
                    f"--combine: seed {result['seed']} is in two of the folders; give each seed once"
                )
            results[result["seed"]] = result
    return [results[seed] for seed in sorted(results)]


def summarize(results: list[dict[str, Any]], out: Path) -> int:
    (out / "hops.json").write_text(json.dumps(results, indent=1))
    for key in ("greedy", "sampled"):
        gains = [r["final"][key] - r["warm"][key] for r in results]
        print(f"hops: test-split {key} gain over {len(results)} seed(s): {statistics.fmean(gains):+.3f} "
              f"(min {min(gains):+.3f}, max {max(gains):+.3f})")  # fmt: skip
    print(f"hops: curves {plot(results, out / 'hops.png')}; numbers {out / 'hops.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
