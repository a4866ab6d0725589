"""Rollout-level vs sample-level vs token-level normalization, at toy scale on a CPU, on rollouts
whose number of samples varies widely and tracks the outcome.

The seed reports that normalizing advantages and loss per rollout gives higher validation reward and
steadier entropy than normalizing per sample (row), when rollouts make different numbers of calls.
This tests it on the hops example (examples/hops): a main agent delegates each hop of a chained
lookup to a sub-agent (a fresh context: its own sample), retries a failed lookup with a new
sub-agent and compacts its context when it grows or after an answer it cannot use (a new sample).
A rollout makes 1 to 16 samples, and failing rollouts make the most, as real agents' do. Three ways
to turn the same rollouts into a loss, each trained from the same warm-started model with the
torch backend (agl_trainer's real advantage and loss code):

  rollout  agl's default: GRPO advantages per rollout, `rollout-mean` (every rollout weighs the same)
  sample   as Agent Lightning does: every sample (row) is its own unit (`advantage_unit: sample`), GRPO
           over the rows of a task, `seq-mean-token-mean` (divide by rows): a rollout with 12 samples
           weighs 12 times one with 1
  token    GRPO per rollout, `token-mean` (divide by tokens): a rollout weighs by its tokens

Rollouts are played in-process (examples/hops/play.py, the harness's own agent program) from the
backend's current weights, so every step is on-policy and nothing runs over HTTP. Validation:
held-out chains, greedy and sampled (mean@4 at temperature 1). Printed per mode: the held-out
rewards at the start and the end (the mean of the last two rounds), entropy drift (mean token
entropy over the last steps minus the first), samples per rollout and their correlation with the
reward; then one line per comparison (sample and token against rollout): the difference of the
final held-out reward and of the entropy drift, paired by seed, with a 95% t-interval over seeds.
Curves: OUT/normalization.png; numbers: OUT/normalization.json.

    python bench/normalization.py            # 3 modes x 5 seeds
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

MODES: dict[str, tuple[str, str]] = {  # name -> (backend.algorithm's loss_agg_mode, advantage_unit)
    "rollout": ("rollout-mean", "rollout"),
    "sample": ("seq-mean-token-mean", "sample"),
    "token": ("token-mean", "rollout"),
}
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


@dataclass
class Settings:
    steps: int = 40
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    tasks_per_step: int = 8
    group_size: int = 8
    val_tasks: int = 64
    val_k: int = 4
    val_every: int = 10
    lr: float = 5e-4
    warmup: int = 0  # steps of linear lr warm-up
    out: Path = Path("runs/bench-normalization")


@dataclass
class Curves:
    mode: str
    seed: int
    train_reward: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)  # mean samples per rollout, per step
    samples_reward_corr: list[float] = field(default_factory=list)  # per step, over the step's rollouts
    val: list[tuple[int, float]] = field(default_factory=list)  # greedy
    val_sampled: list[tuple[int, float]] = field(default_factory=list)  # mean@k at temperature 1
    seconds: float = 0.0


def warm_model(out: Path) -> Path:
    """The hops example's warm-started model (built once, reused by later runs)."""
    warm = out / "model" / "model-warm"
    if not (warm / "config.json").exists():
        from examples.hops.prepare import prepare_hops

        prepare_hops(out / "model", seed=0)
    return warm


def results_for(rollouts: list[Any], version: int) -> list[Any]:
    """The step's rollouts as training input, one result per rollout (the sample mode's units are the
    backend's: `advantage_unit: sample`)."""
    from agl_trainer.batch import RolloutResult, Sample

    results = []
    for index, rollout in enumerate(rollouts):
        samples = [
            Sample(
                f"r{index}",
                rollout.task["id"],
                ids,
                mask,
                [0.0] * len(ids),
                [version if m else -1 for m in mask],
            )
            for ids, mask in rollout.samples()
        ]
        results.append(RolloutResult(f"r{index}", rollout.task["id"], rollout.reward, samples))
    return results


def correlation(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return math.nan
    return statistics.correlation(xs, ys)


def train_run(mode: str, seed: int, warm: Path, settings: Settings) -> Curves:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agl_trainer.algorithms import AlgorithmConfig
    from agl_trainer.backends import TorchBackend, TorchBackendConfig
    from agl_trainer.batch import TrainingBatch
    from examples.hops.play import evaluate, play
    from examples.hops.prepare import val_tasks
    from examples.hops.task import make_tasks
    from examples.hops.tokens import HopsTokens

    torch.manual_seed(seed)
    tokens = HopsTokens(AutoTokenizer.from_pretrained(warm))
    loss_agg_mode, unit = MODES[mode]
    # importance_scope off: every step is on-policy
    algorithm = AlgorithmConfig(loss_agg_mode=loss_agg_mode, advantage_unit=unit, importance_scope="off")
    backend = TorchBackend(
        TorchBackendConfig(
            model_path=warm,
            lr=settings.lr,
            warmup_steps=settings.warmup,
            device="cpu",
            seed=seed,
            algorithm=algorithm,
        )
    )
    sampler = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32).eval()
    train_tasks = make_tasks(512, seed=100 + seed, prefix="train")
    held_out = val_tasks(settings.val_tasks)  # the same held-out set for every run
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    curves = Curves(mode, seed)
    started = time.perf_counter()

    def validate(step: int) -> None:
        scores = evaluate(sampler, tokens, held_out, k=settings.val_k, seed=seed)
        curves.val.append((step, scores["greedy"]))
        curves.val_sampled.append((step, scores["sampled"]))

    validate(0)
    for step in range(1, settings.steps + 1):
        chosen = rng.sample(train_tasks, settings.tasks_per_step)
        rollouts = play(
            sampler,
            tokens,
            [t for t in chosen for _ in range(settings.group_size)],
            temperature=1.0,
            generator=generator,
        )
        batch = TrainingBatch.from_rollouts(results_for(rollouts, step - 1), pad_token_id=tokens.end)
        metrics = backend.train_step(batch, step - 1)
        sampler.load_state_dict(backend.state_dict_for_engine(), strict=False)
        counts = [float(len(r.samples())) for r in rollouts]
        rewards = [r.reward for r in rollouts]
        curves.train_reward.append(statistics.fmean(rewards))
        curves.entropy.append(float(metrics["actor/entropy"]))
        curves.samples.append(statistics.fmean(counts))
        curves.samples_reward_corr.append(correlation(counts, rewards))
        if step % settings.val_every == 0 or step == settings.steps:
            validate(step)
    curves.seconds = time.perf_counter() - started
    return curves


def final(points: list[tuple[int, float]]) -> float:
    last = [value for _, value in points[-2:]]
    return sum(last) / len(last)


def drift(values: list[float], window: int = 5) -> float:
    """The mean of the last `window` values minus the mean of the first (each at most a third of them)."""
    window = max(1, min(window, len(values) // 3))
    return statistics.fmean(values[-window:]) - statistics.fmean(values[:window])


def entropy_drift(curves: Curves, window: int = 5) -> float:
    return drift(curves.entropy, window)


def paired_interval(differences: list[float]) -> tuple[float, float, float]:
    """Mean of per-seed differences and its 95% t-interval (nan bounds for a single seed)."""
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return mean, math.nan, math.nan
    half = T95.get(len(differences) - 1, 1.96) * statistics.stdev(differences) / math.sqrt(len(differences))
    return mean, mean - half, mean + half


def table(runs: list[Curves]) -> list[dict[str, Any]]:
    out = []
    for mode in MODES:
        mine = [c for c in runs if c.mode == mode]
        if not mine:
            continue
        corr = [v for c in mine for v in c.samples_reward_corr if not math.isnan(v)]
        out.append(
            {
                "mode": mode,
                "loss_agg_mode": MODES[mode][0],
                "seeds": len(mine),
                "val_start": statistics.fmean(c.val[0][1] for c in mine),
                "val_final": statistics.fmean(final(c.val) for c in mine),
                "val_sampled_start": statistics.fmean(c.val_sampled[0][1] for c in mine),
                "val_sampled_final": statistics.fmean(final(c.val_sampled) for c in mine),
                "entropy_start": statistics.fmean(c.entropy[0] for c in mine),
                "entropy_drift": statistics.fmean(entropy_drift(c) for c in mine),
                "samples_per_rollout": statistics.fmean(statistics.fmean(c.samples) for c in mine),
                "samples_per_rollout_first": statistics.fmean(c.samples[0] for c in mine),
                "samples_reward_corr": statistics.fmean(corr) if corr else math.nan,
                "seconds_per_run": statistics.fmean(c.seconds for c in mine),
            }
        )
    return out


def comparisons(runs: list[Curves]) -> list[dict[str, Any]]:
    """Each mode against rollout, paired by seed: final greedy and sampled reward, entropy drift."""
    reference = {c.seed: c for c in runs if c.mode == "rollout"}
    out = []
    for mode in MODES:
        if mode == "rollout":
            continue
        pairs = [(c, reference[c.seed]) for c in runs if c.mode == mode and c.seed in reference]
        if not pairs:
            continue
        for metric, of in (
            ("val_greedy", lambda c: final(c.val)),
            ("val_sampled", lambda c: final(c.val_sampled)),
            ("entropy_drift", entropy_drift),
        ):
            mean, low, high = paired_interval([of(c) - of(r) for c, r in pairs])
            reference_mean = statistics.fmean(of(r) for _, r in pairs)
            out.append({"mode": mode, "metric": metric, "seeds": len(pairs), "difference": mean, "low": low,
                        "high": high, "rollout": reference_mean, "other": reference_mean + mean})  # fmt: skip
    return out


def plot(runs: list[Curves], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"rollout": "tab:blue", "sample": "tab:red", "token": "tab:green"}
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2), dpi=100)
    for run in runs:
        first = run.seed == min(c.seed for c in runs if c.mode == run.mode)
        label = f"{run.mode} ({MODES[run.mode][0]})" if first else None
        axes[0].plot(*zip(*run.val), "o-", color=colors[run.mode], alpha=0.6, label=label, markersize=3)
        axes[1].plot(
            *zip(*run.val_sampled), "o-", color=colors[run.mode], alpha=0.6, label=label, markersize=3
        )
        axes[2].plot(
            range(1, len(run.entropy) + 1), run.entropy, color=colors[run.mode], alpha=0.6, label=label
        )
    axes[0].set(title="held-out reward, greedy", xlabel="training step", ylabel="reward")
    axes[1].set(title="held-out reward, sampled (mean@4, T=1)", xlabel="training step", ylabel="reward")
    axes[2].set(title="policy entropy on trained tokens", xlabel="training step", ylabel="nats")
    return save_figure(figure, axes, path)


def save_figure(figure: Any, axes: Any, path: Path) -> Path:
    """Gridded axes with their legends, written to `path` (PNG) and closed."""
    import matplotlib.pyplot as plt

    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def save(runs: list[Curves], settings: Settings) -> Path:
    path = settings.out / "normalization.json"
    data = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(settings).items()},
            "table": table(runs), "comparisons": comparisons(runs), "runs": [vars(c) for c in runs]}  # fmt: skip
    path.write_text(json.dumps(data, indent=1))
    return path


def report(runs: list[Curves], settings: Settings) -> None:
    print(
        f"\nnormalization on hops ({settings.steps} steps x {settings.tasks_per_step} tasks x {settings.group_size} "
        f"rollouts, {len(settings.seeds)} seed(s), lr {settings.lr:g}; held-out: {settings.val_tasks} chains, "
        f"greedy and mean@{settings.val_k})"
    )
    print(f"{'mode':8} {'loss_agg_mode':20} {'greedy':>13} {'sampled':>13} {'entropy drift':>13} "
          f"{'samples/r':>9} {'corr(samples, reward)':>21}")  # fmt: skip
    for row in table(runs):
        print(
            f"{row['mode']:8} {row['loss_agg_mode']:20} {row['val_start']:.3f} -> {row['val_final']:.3f} "
            f"{row['val_sampled_start']:.3f} -> {row['val_sampled_final']:.3f} {row['entropy_drift']:+13.3f} "
            f"{row['samples_per_rollout']:9.2f} {row['samples_reward_corr']:+21.2f}"
        )
    for row in comparisons(runs):
        print(
            f"{row['mode']} - rollout, {row['metric']}: {row['difference']:+.3f} "
            f"(95% CI {row['low']:+.3f} .. {row['high']:+.3f}, {row['seeds']} seeds paired; "
            f"rollout {row['rollout']:.3f}, {row['mode']} {row['other']:.3f})"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="1 seed, 6 steps (a smoke run of a minute or two)"
    )
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (default 5; --quick 1)")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument(
        "--tasks-per-step", type=int, default=None, help="tasks a step (each run group-size times)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="steps of linear lr warm-up")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES)
    )
    parser.add_argument("--out", default=None, help="default runs/bench-normalization (--quick: .../quick)")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown} (choose from {', '.join(MODES)})")
    out = Path(args.out or ("runs/bench-normalization/quick" if args.quick else "runs/bench-normalization"))
    settings = Settings(out=out)
    if args.quick:
        settings = Settings(
            steps=6, seeds=(0,), tasks_per_step=4, val_tasks=16, val_k=2, val_every=3, out=out
        )
    if args.steps is not None:
        settings.steps = args.steps
    if args.seeds is not None:
        settings.seeds = tuple(range(args.seeds))
    if args.lr is not None:
        settings.lr = args.lr
    if args.tasks_per_step is not None:
        settings.tasks_per_step = args.tasks_per_step
    if args.warmup is not None:
        settings.warmup = args.warmup
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)  # tiny ops: one thread is fastest, and the machine is shared
    settings.out.mkdir(parents=True, exist_ok=True)
    warm = warm_model(settings.out)
    runs = []
    for seed in settings.seeds:
        for mode in modes:
            curves = train_run(mode, seed, warm, settings)
            runs.append(curves)
            save(runs, settings)  # after every run: a long run interrupted still leaves its numbers
            print(
                f"  {mode:8} seed {seed}: held-out greedy {curves.val[0][1]:.3f} -> {final(curves.val):.3f}, "
                f"sampled {curves.val_sampled[0][1]:.3f} -> {final(curves.val_sampled):.3f}, entropy "
                f"{curves.entropy[0]:.3f} -> {curves.entropy[-1]:.3f}, samples/rollout {curves.samples[0]:.1f} -> "
                f"{curves.samples[-1]:.1f} ({curves.seconds:.0f} s)",
                flush=True,
            )
    report(runs, settings)
    png = plot(runs, settings.out / "normalization.png")
    print(f"curves: {png}; numbers: {save(runs, settings)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
