"""Validation rounds: the held-out tasks (`val_tasks`), run as rollouts, never trained.

When (loop.val_every = N > 0): one round before the first training step (the starting policy,
reported at step 0), one after every N-th step, and one when training ends (loop.max_steps or
loop.max_train_s) unless that step already had one. A stop the user asked for (Ctrl-C) skips the
final round. A resumed run validates at its first step only when that step is due.

A round has up to two passes over every val task, through the same runner, harness and sidecar
as training, run together:
  - `loop.val_repeats` rollouts in mode `val`: the runner puts the mode in the rollout's URL
    (`/rollouts/{id}/modes/val/v1`), so the sidecar applies `sampling.val` (greedy by default)
    without any change to the harness. A greedy policy can solve a task every time while the
    policy RL samples from still fails it often, so greedy alone may not move while RL improves.
  - `loop.val_sampled` = k rollouts in mode `train` (sampling.train, the training temperature):
    mean@k, the held-out counterpart of the training reward. Mode train only selects the sampling;
    their ids (`...-valNNNNNN-...-s{j}`) and the store's drop reason say they are validation.
Neither pass's rollouts enter a training batch (the loop trains only the groups it scheduled),
and both are marked in the store as dropped with the reason `validation`, so no later pass
(e.g. `agl train --from-store`) trains them.

Receipts: each pass of a round writes OUTPUT_DIR/receipts/val-stepNNNNNN-{greedy,sampled}.{results,
receipt}.json, the same receipt as `agl eval` (eval/rounds.py).

Metrics, one row per round at the step it measured (metrics.jsonl, TensorBoard, metrics.prom):
  val/reward       mean reward of the mode-val rollouts that produced data (greedy by default)
  val/reward_std   their standard deviation
  val/pass_rate    fraction of them with full reward (>= 1)
  val/count        rollouts with data;  val/failed: rollouts without (harness error, timeout, no data)
  val/sampled/reward    mean@k: mean reward of the sampled rollouts (loop.val_sampled > 0)
  val/sampled/pass@k    fraction of val tasks with a full reward in at least one of their k samples
  val/sampled/count, val/sampled/failed, val/sampled/k
  val/seconds      wall time of the round;  val/policy_version: the weights it measured
"""

from __future__ import annotations

import asyncio
import datetime
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from agl import semconv
from agl_trainer.runners.base import Cause, RolloutOutcome, RolloutSpec
from agl_trainer.store.records import RolloutKey

VAL_DROP_REASON = "validation"  # how the store records that a val rollout is never to be trained
PASS_REWARD = 1.0
POLL_S = 0.05
SAMPLED = "val/sampled/"  # the sampled pass's metric prefix
# How long a round (and agl eval) waits for the sidecar to deliver the spans of its finished calls.
SETTLE_TIMEOUT_S = 30.0


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
        sampled: int = 0,
        no_data_timeout_s: float = 60.0,
        on_round: Callable[..., Any] | None = None,
        settle: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        if repeats < 1 or sampled < 0:
            raise ValueError(f"Validator: repeats must be >= 1 and sampled >= 0, got {repeats} and {sampled}")
        self.tasks = tasks
        self.runner = runner
        self.data = data
        self.run_id = run_id
        self.plan = ValidationPlan(every)
        self.repeats = repeats
        self.sampled = sampled
        self.no_data_timeout_s = no_data_timeout_s
        # on_round(step=, version=, specs=, rewards=, started_at=, ended_at=): the round's receipts (eval/rounds.py)
        self.on_round = on_round
        # Awaited once a round's harnesses ended, before its data is read: the sidecar's spans of their
        # calls delivered (without it a call span slower than loop.completion_grace_s is left out).
        self.settle = settle
        self.last_step: int | None = None  # the step the latest round measured
        self.rounds = 0
        self.last_failures: list[str] = []  # why each rollout of the latest round gave no reward
        # Ids stay unique when a resumed run (same run id) validates a step the crashed one did.
        self._instance = secrets.token_hex(2)

    def specs(self, step: int) -> list[RolloutSpec]:
        """The round's rollouts: the mode-val pass, then the sampled pass (ids ending `-s{j}`)."""
        prefix = f"{self.run_id}-val{step:06d}-{self._instance}r{self.rounds}"
        greedy = [
            RolloutSpec(f"{prefix}-{index:04d}-{repeat}", str(task["id"]), task, 0, semconv.MODE_VAL)
            for index, task in enumerate(self.tasks)
            for repeat in range(self.repeats)
        ]
        sampled = [
            RolloutSpec(f"{prefix}-{index:04d}-s{repeat}", str(task["id"]), task, 0, semconv.MODE_TRAIN)
            for index, task in enumerate(self.tasks)
            for repeat in range(self.sampled)
        ]
        return greedy + sampled

    async def run(self, step: int, version: int, check: Callable[[], None] = lambda: None) -> dict[str, float]:
        """One round at `step`; returns its val/* metrics. `check` raises to abandon the round
        (a stop request): the round's harnesses are cancelled and the exception propagates."""
        started = time.monotonic()
        started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        specs = self.specs(step)
        self.rounds += 1
        outcomes, by_id = await collect(specs, self.runner, self.data, self.no_data_timeout_s, check, self.settle)
        if self.on_round is not None:
            ended_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
            await asyncio.to_thread(
                self.on_round, step=step, version=version, specs=specs, rewards=by_id, started_at=started_at,
                ended_at=ended_at,
            )  # fmt: skip
        self.data.mark_dropped([RolloutKey(o.spec.rollout_id, o.spec.attempt) for o in outcomes], VAL_DROP_REASON)
        self.last_step = step
        self.last_failures = [f for o in outcomes if (f := failure(o, o.spec.rollout_id in by_id)) is not None]
        greedy = [spec for spec in specs if spec.mode == semconv.MODE_VAL]
        rewards = [by_id[spec.rollout_id] for spec in greedy if spec.rollout_id in by_id]
        metrics = summarize(rewards, attempted=len(greedy))
        if self.sampled:
            samples: dict[str, list[float]] = {}  # task id -> rewards of its sampled rollouts with data
            sampled = [spec for spec in specs if spec.mode != semconv.MODE_VAL]
            for spec in sampled:
                if spec.rollout_id in by_id:
                    samples.setdefault(spec.task_id, []).append(by_id[spec.rollout_id])
            metrics.update(summarize_sampled(samples, attempted=len(sampled), k=self.sampled))
        metrics["val/seconds"] = time.monotonic() - started
        metrics["val/policy_version"] = float(version)
        return metrics


async def collect(
    specs: list[RolloutSpec],
    runner: Any,
    data: Any,
    no_data_timeout_s: float,
    check: Callable[[], None] = lambda: None,
    settle: Callable[[], Awaitable[Any]] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> tuple[list[RolloutOutcome], dict[str, float]]:
    """Run `specs` through `runner` (its concurrency bounds them), wait for their data in the store,
    and return each outcome and the reward of every rollout with data, by rollout id (validation
    rounds and `agl eval` both). `check` raises to abandon: the harnesses are cancelled, it propagates.
    `settle` runs once every harness has ended, before the data is read (the sidecar's spans of their
    calls delivered, so a call span slower than loop.completion_grace_s is not left out). `on_ready` is
    called once the data is complete, before it is assembled (agl eval times the attempts with it)."""
    tasks = [asyncio.create_task(runner.run(spec), name=spec.rollout_id) for spec in specs]
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
    if settle is not None:
        await settle()
    keys = [RolloutKey(o.spec.rollout_id, o.spec.attempt) for o in outcomes if o.ok]
    complete = await _wait_complete(data, keys, no_data_timeout_s, check)
    if on_ready is not None:
        on_ready()
    by_id: dict[str, float] = {}
    if complete:
        assembled = await asyncio.to_thread(data.assemble, sorted(complete, key=lambda k: k.rollout_id))
        by_id = {result.rollout_id: result.reward for result in assembled.results}
    return outcomes, by_id


async def _wait_complete(
    data: Any, keys: list[RolloutKey], no_data_timeout_s: float, check: Callable[[], None]
) -> set[RolloutKey]:
    deadline = time.monotonic() + no_data_timeout_s
    complete: set[RolloutKey] = set()
    while keys and time.monotonic() < deadline:
        complete = data.complete(keys)
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


def summarize_sampled(samples: dict[str, list[float]], attempted: int, k: int) -> dict[str, float]:
    """val/sampled/* of one round: each task's rewards over its (up to k) samples with data."""
    rewards = [reward for task_rewards in samples.values() for reward in task_rewards]
    metrics = {
        f"{SAMPLED}count": float(len(rewards)),
        f"{SAMPLED}failed": float(attempted - len(rewards)),
        f"{SAMPLED}k": float(k),
    }
    if rewards:
        metrics[f"{SAMPLED}reward"] = sum(rewards) / len(rewards)  # mean@k
        solved = [any(r >= PASS_REWARD for r in task_rewards) for task_rewards in samples.values()]
        metrics[f"{SAMPLED}pass@k"] = sum(solved) / len(solved)
    return metrics


def failure(outcome: RolloutOutcome, has_data: bool) -> str | None:
    """Why a round's rollout gave no reward, in a line (None when it gave one)."""
    if outcome.ok and has_data:
        return None
    if outcome.ok:
        return f"{outcome.spec.rollout_id}: the harness ended well but its data never completed in the store"
    detail = f": {outcome.message}" if outcome.message else ""
    where = f" (log: {outcome.log_path})" if outcome.log_path else ""
    return f"{outcome.spec.rollout_id}: {outcome.cause.value}{detail}{where}"


def summarize(rewards: list[float], attempted: int) -> dict[str, float]:
    """val/* metrics of one round: `rewards` of the rollouts with data, out of `attempted`."""
    metrics = {"val/count": float(len(rewards)), "val/failed": float(attempted - len(rewards))}
    if rewards:
        mean = sum(rewards) / len(rewards)
        metrics["val/reward"] = mean
        metrics["val/reward_std"] = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        metrics["val/pass_rate"] = sum(r >= PASS_REWARD for r in rewards) / len(rewards)
    return metrics
