"""Make the demo's starting model: build it at random, warm start it, and measure both.

    from examples.demo.prepare import prepare_demo_model
    prepared = prepare_demo_model("runs/demo", seed=0)
    prepared.path            # runs/demo/model-warm: what RL starts from (engine and trainer load it)
    prepared.reward_init     # mean reward of the random model (about 0.03)
    prepared.reward_warm     # after the warm start, before RL (about 0.45-0.55)

Evaluation samples at temperature 1 on held-out tasks (the test split, seed + 10_000: pairs the
warm start's demonstrations never show), 64 tasks x 4 episodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from examples.demo.episodes import DemoTokens, mean_reward
from examples.demo.model import build_demo_model
from examples.demo.task import make_tasks

WARM_START_DEMOS = 64
WARM_START_STEPS = 60
WARM_START_LR = 1e-3
EVAL_TASKS = 64


def warm_start_tasks(seed: int = 0) -> list[dict[str, Any]]:
    """The tasks the warm start demonstrates: training-split tasks, as RL's."""
    return make_tasks(WARM_START_DEMOS, seed + 1, "train")


@dataclass
class PreparedModel:
    path: Path
    initial_path: Path
    reward_init: float
    reward_warm: float
    warm_start_seconds: float


def prepare_demo_model(
    workdir: str | Path,
    *,
    seed: int = 0,
    steps: int = WARM_START_STEPS,
    lr: float = WARM_START_LR,
    progress: bool = True,
) -> PreparedModel:
    import torch
    from examples.demo.warmstart import WarmStartConfig, supervised_warm_start
    from transformers import AutoModelForCausalLM, AutoTokenizer

    workdir = Path(workdir)
    initial = build_demo_model(workdir / "model-init", seed=seed)
    tokens = DemoTokens(AutoTokenizer.from_pretrained(initial))
    held_out = make_tasks(EVAL_TASKS, seed + 10_000, "test")
    reward_init = mean_reward(
        AutoModelForCausalLM.from_pretrained(initial, dtype=torch.float32), tokens, held_out, seed=seed
    )
    demos = [tokens.demonstration(t) for t in warm_start_tasks(seed)]
    result = supervised_warm_start(
        initial,
        workdir / "model-warm",
        demos,
        WarmStartConfig(steps=steps, lr=lr, seed=seed),
        progress=progress,
    )
    warm = AutoModelForCausalLM.from_pretrained(result.path, dtype=torch.float32)
    reward_warm = mean_reward(warm, tokens, held_out, seed=seed)
    return PreparedModel(result.path, initial, reward_init, reward_warm, result.seconds)
