"""What a training step reports beside the backend's metrics: its times, what its batch held
and the rewards of its rollouts, whichever source the rollouts came from."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from agl_trainer.batch import TrainingBatch


@dataclass
class StepTimes:
    generating: float = 0.0  # waiting for the batch: generating it (live), reading it (stored)
    draining: float = 0.0
    training: float = 0.0
    syncing: float = 0.0
    checkpoint: float = 0.0
    idle: float = 0.0
    canary: float = 0.0
    overlapped: float = 0.0  # of training, time the engine went on generating (loop.generate_during_training)

    def metrics(self, *, engine: bool = True) -> dict[str, float]:
        """time/*; `engine`: an engine generated the batch (its idle fraction), else it was read."""
        wall = self.generating + self.draining + self.training + self.syncing + self.checkpoint + self.canary
        if not engine:
            return {
                "time/reading_s": self.generating,
                "time/training_s": self.training,
                "time/checkpoint_s": self.checkpoint,
                "time/step_s": wall,
            }
        busy = max(0.0, self.generating + self.overlapped - self.idle) + self.draining
        return {
            "time/generating_s": self.generating,
            "time/draining_s": self.draining,
            "time/training_s": self.training,
            "time/syncing_s": self.syncing,
            "time/checkpoint_s": self.checkpoint,
            "time/idle_s": self.idle,
            "time/generating_during_training_s": self.overlapped,
            "time/step_s": wall,
            "engine/idle_fraction": 1.0 - busy / wall if wall > 0 else 0.0,
        }


def number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) or hasattr(value, "item")


def batch_metrics(batch: TrainingBatch) -> dict[str, float]:
    """What the batch handed to the backend holds; staleness/* of the tokens that entered the loss
    come from the backend's step plan (algorithms/token_age.py)."""
    trained = int((batch.loss_mask > 0).sum())
    if trained == 0:
        return {}
    return {"tokens/trained": float(trained), "samples": float(batch.num_samples)}


def reward_metrics(rewards: list[float]) -> dict[str, float]:
    """reward/* over the trained rollouts: the step's one source (the backends report none)."""
    if not rewards:
        return {}
    mean = sum(rewards) / len(rewards)
    return {
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
        "reward/min": min(rewards),
        "reward/max": max(rewards),
    }
