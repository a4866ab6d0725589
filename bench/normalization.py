"""Rollout-level vs sample-level vs token-level normalization, at toy scale on a CPU.

The seed reports that normalizing advantages and loss per rollout gives higher validation reward and
steadier entropy than normalizing per sample (row), when rollouts make different numbers of calls.
This reproduces the comparison on bench/_hops.py: chained lookups where each hop runs in a fresh
context, so a rollout makes 2 calls and 1 sample per hop, 1 to 4 hops, as the task and the policy
decide. Three ways to turn the same rollouts into a loss, each trained from the same warm-started
tiny demo model with the torch backend (agl_trainer's real advantage and loss code):

  rollout  agl's default: GRPO advantages per rollout, `rollout-mean` (every rollout weighs the same)
  sample   as Agent Lightning does: every sample (row) is its own unit, GRPO over the rows of a task,
           `seq-mean-token-mean` (divide by rows): a rollout with 4 samples weighs 4 times one with 1
  token    GRPO per rollout, `token-mean` (divide by tokens): a rollout weighs by its tokens

Rollouts are sampled in-process (examples/demo/sampling.py) from the backend's current weights, so
every step is on-policy and nothing runs over HTTP. Validation: held-out chains (another seed),
greedy, every --val-every steps. Printed: final validation reward (mean +- std over seeds; the
mean of the last two rounds of each run), its ratio to the rollout-level reference measured in the
same run, and entropy drift (mean token entropy over the last steps minus the first steps).
Curves: OUT/normalization.png; numbers: OUT/normalization.json.

    python bench/normalization.py            # 3 modes x 3 seeds (minutes on 2 cores)
    python bench/normalization.py --quick    # 3 modes x 1 seed, few steps (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._hops import make_chain_tasks, play, rows  # noqa: E402

MODES: dict[str, tuple[str, bool]] = {  # name -> (loss_agg_mode, advantages and weights per rollout)
    "rollout": ("rollout-mean", True),
    "sample": ("seq-mean-token-mean", False),
    "token": ("token-mean", True),
}


@dataclass
class Settings:
    steps: int = 100
    seeds: tuple[int, ...] = (0, 1, 2)
    tasks_per_step: int = 8
    group_size: int = 8
    val_tasks: int = 64
    val_every: int = 10
    lr: float = 1e-3
    out: Path = Path("runs/bench-normalization")


@dataclass
class Curves:
    mode: str
    seed: int
    train_reward: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    calls: list[float] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0


def warm_model(out: Path) -> Path:
    """The demo's warm-started tiny model (built once, reused by later runs)."""
    warm = out / "model" / "model-warm"
    if not (warm / "config.json").exists():
        from examples.demo.prepare import prepare_demo_model

        prepare_demo_model(out / "model", seed=0, progress=False)
    return warm


def results_for(mode: str, rollouts: list[Any], version: int, tokens: Any) -> list[Any]:
    """The step's rollouts as training input: per rollout, or (mode sample) one unit per row."""
    from agl_trainer.batch import RolloutResult, Sample

    results = []
    for index, rollout in enumerate(rollouts):
        samples = [
            Sample(f"r{index}", rollout.task["id"], ids, mask, [0.0] * len(ids), [version if m else -1 for m in mask])
            for ids, mask in rows(rollout)
        ]
        if MODES[mode][1]:
            results.append(RolloutResult(f"r{index}", rollout.task["id"], rollout.reward, samples))
        else:
            results += [RolloutResult(f"r{index}/{k}", s.task_id, rollout.reward, [s]) for k, s in enumerate(samples)]
    return results


def train_run(mode: str, seed: int, warm: Path, settings: Settings) -> Curves:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agl_trainer.algorithms import AlgorithmConfig
    from agl_trainer.backends import TorchBackend, TorchBackendConfig
    from agl_trainer.batch import TrainingBatch
    from examples.demo.episodes import DemoTokens

    torch.manual_seed(seed)
    tokens = DemoTokens(AutoTokenizer.from_pretrained(warm))
    algorithm = AlgorithmConfig(loss_agg_mode=MODES[mode][0], importance_scope="off")  # on-policy
    backend = TorchBackend(TorchBackendConfig(model_path=warm, lr=settings.lr, device="cpu", seed=seed, algorithm=algorithm))
    sampler = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32).eval()
    train_tasks = make_chain_tasks(512, seed=100 + seed)
    val_tasks = make_chain_tasks(settings.val_tasks, seed=10_000)  # the same held-out set for every run
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    curves = Curves(mode, seed)
    started = time.perf_counter()

    def validate(step: int) -> None:
        rollouts = play(sampler, tokens, val_tasks, temperature=0.0)
        curves.val.append((step, sum(r.reward for r in rollouts) / len(rollouts)))

    validate(0)
    for step in range(1, settings.steps + 1):
        chosen = rng.sample(train_tasks, settings.tasks_per_step)
        rollouts = play(
            sampler, tokens, [t for t in chosen for _ in range(settings.group_size)], temperature=1.0, generator=generator
        )
        batch = TrainingBatch.from_rollouts(results_for(mode, rollouts, step - 1, tokens), pad_token_id=tokens.end)
        metrics = backend.train_step(batch, step - 1)
        sampler.load_state_dict(backend.state_dict_for_engine(), strict=False)
        curves.train_reward.append(sum(r.reward for r in rollouts) / len(rollouts))
        curves.entropy.append(float(metrics["actor/entropy"]))
        curves.calls.append(sum(r.calls for r in rollouts) / len(rollouts))
        curves.samples.append(sum(len(rows(r)) for r in rollouts) / len(rollouts))
        if step % settings.val_every == 0 or step == settings.steps:
            validate(step)
    curves.seconds = time.perf_counter() - started
    return curves


def final_val(curves: Curves) -> float:
    last = [value for _, value in curves.val[-2:]]
    return sum(last) / len(last)


def entropy_drift(curves: Curves, window: int = 5) -> float:
    window = max(1, min(window, len(curves.entropy) // 3))
    return statistics.fmean(curves.entropy[-window:]) - statistics.fmean(curves.entropy[:window])


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def table(runs: list[Curves]) -> list[dict[str, Any]]:
    out = []
    for mode in MODES:
        mine = [c for c in runs if c.mode == mode]
        if not mine:
            continue
        val, val_std = _mean_std([final_val(c) for c in mine])
        drift, drift_std = _mean_std([entropy_drift(c) for c in mine])
        out.append(
            {
                "mode": mode,
                "loss_agg_mode": MODES[mode][0],
                "seeds": len(mine),
                "val_start": statistics.fmean(c.val[0][1] for c in mine),
                "val_final": val,
                "val_final_std": val_std,
                "entropy_start": statistics.fmean(c.entropy[0] for c in mine),
                "entropy_drift": drift,
                "entropy_drift_std": drift_std,
                "calls_per_rollout": statistics.fmean(statistics.fmean(c.calls) for c in mine),
                "samples_per_rollout": statistics.fmean(statistics.fmean(c.samples) for c in mine),
                "seconds_per_run": statistics.fmean(c.seconds for c in mine),
            }
        )
    reference = next((row["val_final"] for row in out if row["mode"] == "rollout"), None)
    for row in out:
        row["val_vs_rollout"] = row["val_final"] / reference if reference else math.nan
    return out


def plot(runs: list[Curves], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"rollout": "tab:blue", "sample": "tab:red", "token": "tab:green"}
    figure, (val_axis, entropy_axis) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    for run in runs:
        first = run.seed == min(c.seed for c in runs if c.mode == run.mode)
        label = f"{run.mode} ({MODES[run.mode][0]})" if first else None
        val_axis.plot(*zip(*run.val), "o-", color=colors[run.mode], alpha=0.7, label=label, markersize=3)
        entropy_axis.plot(range(1, len(run.entropy) + 1), run.entropy, color=colors[run.mode], alpha=0.7, label=label)
    val_axis.set(title="validation reward (held-out chains, greedy)", xlabel="training step", ylabel="reward")
    entropy_axis.set(title="policy entropy on trained tokens", xlabel="training step", ylabel="nats")
    for axis in (val_axis, entropy_axis):
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def save(runs: list[Curves], settings: Settings) -> Path:
    path = settings.out / "normalization.json"
    data = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(settings).items()},
            "table": table(runs), "runs": [vars(c) for c in runs]}  # fmt: skip
    path.write_text(json.dumps(data, indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 12 steps (a smoke run of a minute or two)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (default 3; --quick 1)")
    parser.add_argument("--out", default=None, help="default runs/bench-normalization (--quick: .../quick)")
    args = parser.parse_args(argv)
    out = Path(args.out or ("runs/bench-normalization/quick" if args.quick else "runs/bench-normalization"))
    settings = Settings(out=out)
    if args.quick:
        settings = Settings(steps=12, seeds=(0,), tasks_per_step=4, val_tasks=32, val_every=6, out=out)
    if args.steps is not None:
        settings.steps = args.steps
    if args.seeds is not None:
        settings.seeds = tuple(range(args.seeds))
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)  # tiny ops: one thread is fastest, and the machine is shared
    settings.out.mkdir(parents=True, exist_ok=True)
    warm = warm_model(settings.out)
    runs = []
    for seed in settings.seeds:
        for mode in MODES:
            curves = train_run(mode, seed, warm, settings)
            runs.append(curves)
            save(runs, settings)  # after every run: a long run interrupted still leaves its numbers
            print(
                f"  {mode:8} seed {seed}: val {curves.val[0][1]:.3f} -> {final_val(curves):.3f}, "
                f"entropy {curves.entropy[0]:.3f} -> {curves.entropy[-1]:.3f} ({curves.seconds:.0f} s)",
                flush=True,
            )
    rows_out = table(runs)
    print(
        f"\nnormalization on chained lookups ({settings.steps} steps x {settings.tasks_per_step} tasks x "
        f"{settings.group_size} rollouts, {len(settings.seeds)} seed(s); val: {settings.val_tasks} held-out chains, greedy)"
    )
    print(f"{'mode':8} {'loss_agg_mode':20} {'val start':>9} {'val final (mean +- std)':>24} {'vs rollout':>10} "
          f"{'entropy drift':>16} {'calls/r':>7} {'samples/r':>9}")  # fmt: skip
    for row in rows_out:
        print(
            f"{row['mode']:8} {row['loss_agg_mode']:20} {row['val_start']:9.3f} "
            f"{row['val_final']:15.3f} +- {row['val_final_std']:.3f} {row['val_vs_rollout']:10.2f} "
            f"{row['entropy_drift']:+9.3f} +- {row['entropy_drift_std']:.3f} "
            f"{row['calls_per_rollout']:7.2f} {row['samples_per_rollout']:9.2f}"
        )
    png = plot(runs, settings.out / "normalization.png")
    print(f"curves: {png}; numbers: {save(runs, settings)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
