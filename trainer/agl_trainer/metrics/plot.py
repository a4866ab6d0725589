"""reward.png: mean training reward, validation reward and entropy per training step, from metrics.jsonl.

Training rows carry reward/mean; validation rounds (loop/validation.py) write their own rows with
val/reward (sampling.val: greedy by default) and val/sampled/reward (mean@k at the training
sampling) at the step they measured (step 0: before training), drawn beside the training reward."""

from __future__ import annotations

from pathlib import Path

from agl_trainer.metrics.writer import read_jsonl

REWARD_KEY = "reward/mean"
VAL_KEY = "val/reward"
VAL_SAMPLED_KEY = "val/sampled/reward"
ENTROPY_KEYS = ("actor/entropy", "entropy", "policy/entropy")


def plot_run(output_dir: Path, *, title: str = "agl training") -> Path | None:
    """Draw reward (left axis) and entropy (right axis) per step; None when nothing was trained."""
    every = read_jsonl(Path(output_dir) / "metrics.jsonl")
    rows = [row for row in every if REWARD_KEY in row]
    if not rows:
        return None
    validation = [(row["step"], row[VAL_KEY]) for row in every if VAL_KEY in row]
    sampled = [row for row in every if VAL_SAMPLED_KEY in row]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in rows]
    figure, reward_axis = plt.subplots(figsize=(8, 4.5), dpi=100)
    reward_axis.plot(steps, [row[REWARD_KEY] for row in rows], color="tab:blue", label="training reward (mean)")
    if validation:
        label = "held-out reward (sampling.val, greedy by default)"
        reward_axis.plot(*zip(*validation), "o-", color="tab:green", label=label)
    if sampled:
        k = sampled[-1].get("val/sampled/k")
        label = f"held-out reward, sampled (mean@{k:.0f})" if k else "held-out reward, sampled"
        points = [(row["step"], row[VAL_SAMPLED_KEY]) for row in sampled]
        reward_axis.plot(*zip(*points), "s-", color="tab:purple", label=label)
    reward_axis.set_xlabel("training step")
    reward_axis.set_ylabel("reward", color="tab:blue")
    reward_axis.set_ylim(bottom=min(0.0, reward_axis.get_ylim()[0]))
    entropy_key = next((key for key in ENTROPY_KEYS if any(key in row for row in rows)), None)
    if entropy_key is not None:
        entropy_axis = reward_axis.twinx()
        points = [(row["step"], row[entropy_key]) for row in rows if entropy_key in row]
        entropy_axis.plot(*zip(*points), color="tab:orange", label="entropy")
        entropy_axis.set_ylabel("entropy", color="tab:orange")
    reward_axis.legend(loc="lower right", fontsize="small")
    reward_axis.set_title(title)
    reward_axis.grid(alpha=0.3)
    figure.tight_layout()
    path = Path(output_dir) / "reward.png"
    figure.savefig(path)
    plt.close(figure)
    return path
