"""Validation rounds: the held-out tasks (`val_tasks`), run as rollouts in mode `val`, never trained.

When (loop.val_every = N > 0): one round before the first training step (the starting policy,
reported at step 0), one after every N-th step, and one when training ends (loop.max_steps or
loop.max_train_s) unless that step already had one. A stop the user asked for (Ctrl-C) skips the
final round. A resumed run validates at its first step only when that step is due.

A round runs every val task `loop.val_repeats` times through the same runner, harness and sidecar
as training. The runner puts the mode in the rollout's URL (`/rollouts/{id}/modes/val/v1`), so
the sidecar applies `sampling.val` (greedy by default) without any change to the harness. The
rounds' rollouts never enter a training batch (the loop trains only the groups it scheduled) and
are marked in the store as dropped with the reason `validation`, so no later pass trains them.

Metrics, one row per round at the step it measured (metrics.jsonl, TensorBoard, metrics.prom):
  val/reward       mean reward of the rollouts that produced data
  val/reward_std   their standard deviation
  val/pass_rate    fraction of them with full reward (>= 1)
  val/count        rollouts with data;  val/failed: rollouts without (harness error, timeout, no data)
  val/seconds      wall time of the round;  val/policy_version: the weights it measured
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agl import semconv
from agl_trainer.runners.base import Cause, RolloutOutcome, RolloutSpec
from agl_trainer.store.records import RolloutKey

VAL_DROP_REASON = "validation"  # how the store records that a val rollout is never to be trained
PASS_REWARD = 1.0
POLL_S = 0.05


@dataclass(frozen=True)
class ValidationPlan:
    """When rounds run: before the first step, every `every` steps, and at the end."""

    every: int

    def due(self, step: int) -> bool:
        """A round is due at step 0 (before training) and at every multiple of `every`."""
        return self.every > 0 and step % self.every == 0


class Validator:
    def __init__(
        self,
        tasks: list[dict[str, Any]],
        *,
        runner: Any,
        data: Any,
        run_id: str,
        every: int,
        repeats: int = 1,
        no_data_timeout_s: float = 60.0,
    ) -> None:
        self.tasks = tasks
        self.runner = runner
        self.data = data
        self.run_id = run_id
        self.plan = ValidationPlan(every)
        self.repeats = repeats
        self.no_data_timeout_s = no_data_timeout_s
        self.last_step: int | None = None  # the step the latest round measured
        self.rounds = 0
        # Ids stay unique when a resumed run (same run id) validates a step the crashed one did.
        self._instance = secrets.token_hex(2)

    def specs(self, step: int) -> list[RolloutSpec]:
        prefix = f"{self.run_id}-val{step:06d}-{self._instance}r{self.rounds}"
        return [
            RolloutSpec(f"{prefix}-{index:04d}-{repeat}", str(task["id"]), task, 0, semconv.MODE_VAL)
            for index, task in enumerate(self.tasks)
            for repeat in range(self.repeats)
        ]

    async def run(self, step: int, version: int, check: Callable[[], None] = lambda: None) -> dict[str, float]:
        """One round at `step`; returns its val/* metrics. `check` raises to abandon the round
        (a stop request): the round's harnesses are cancelled and the exception propagates."""
        started = time.monotonic()
        specs = self.specs(step)
        self.rounds += 1
        tasks = [asyncio.create_task(self.runner.run(spec), name=spec.rollout_id) for spec in specs]
        try:
            while not all(task.done() for task in tasks):
                check()
                await asyncio.sleep(POLL_S)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        outcomes = [_outcome(task, spec) for task, spec in zip(tasks, specs)]
        keys = [RolloutKey(o.spec.rollout_id, o.spec.attempt) for o in outcomes if o.ok]
        complete = await self._wait_complete(keys, check)
        rewards: list[float] = []
        if complete:
            assembled = await asyncio.to_thread(self.data.assemble, sorted(complete, key=lambda k: k.rollout_id))
            rewards = [result.reward for result in assembled.results]
        all_keys = [RolloutKey(o.spec.rollout_id, o.spec.attempt) for o in outcomes]
        self.data.mark_dropped(all_keys, VAL_DROP_REASON)
        self.last_step = step
        metrics = summarize(rewards, attempted=len(specs))
        metrics["val/seconds"] = time.monotonic() - started
        metrics["val/policy_version"] = float(version)
        return metrics

    async def _wait_complete(self, keys: list[RolloutKey], check: Callable[[], None]) -> set[RolloutKey]:
        deadline = time.monotonic() + self.no_data_timeout_s
        complete: set[RolloutKey] = set()
        while keys and time.monotonic() < deadline:
            complete = self.data.complete(keys)
            if len(complete) == len(keys):
                break
            check()
            await asyncio.sleep(POLL_S)
        return complete


def _outcome(task: asyncio.Task[RolloutOutcome], spec: RolloutSpec) -> RolloutOutcome:
    if task.cancelled():
        return RolloutOutcome(spec, Cause.CANCELLED)
    if task.exception() is not None:
        return RolloutOutcome(spec, Cause.INFRA_ERROR, message=repr(task.exception()))
    return task.result()


def summarize(rewards: list[float], attempted: int) -> dict[str, float]:
    """val/* metrics of one round: `rewards` of the rollouts with data, out of `attempted`."""
    metrics = {"val/count": float(len(rewards)), "val/failed": float(attempted - len(rewards))}
    if rewards:
        mean = sum(rewards) / len(rewards)
        metrics["val/reward"] = mean
        metrics["val/reward_std"] = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        metrics["val/pass_rate"] = sum(r >= PASS_REWARD for r in rewards) / len(rewards)
    return metrics
