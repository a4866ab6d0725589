"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay to a floor."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")


def lr_multiplier(
    step: int, *, warmup_steps: int, total_steps: int | None, schedule: str, min_lr_ratio: float
) -> float:
    """Factor on the base learning rate for optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if total_steps is None:
        raise ValueError(f"lr schedule {schedule!r} needs total_steps")
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


class LRLambda:
    """A picklable callable for LambdaLR (a closure would make the scheduler's state unsaveable)."""

    def __init__(
        self, warmup_steps: int, total_steps: int | None, schedule: str, min_lr_ratio: float
    ) -> None:
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.schedule, self.min_lr_ratio = schedule, min_lr_ratio

    def __call__(self, step: int) -> float:
        return lr_multiplier(
            step,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            schedule=self.schedule,
            min_lr_ratio=self.min_lr_ratio,
        )


@contextmanager
def schedule_may_lead() -> Iterator[None]:
    """Step the LR schedule without torch's "lr_scheduler.step() before optimizer.step()" warning: a
    run whose first update was left out (no signal, or a non-finite gradient) does that on purpose,
    since the schedule counts the steps taken or not."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
        yield
