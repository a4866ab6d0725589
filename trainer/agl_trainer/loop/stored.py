"""The stored rollout source: `agl train CONFIG --from-store traces.db` trains on rollouts collected
earlier, off-policy (ports.RolloutSource; the loop is the one `agl train` runs).

Production harnesses call the model through a sidecar and report rewards with `agl.emit_reward()`;
`agl receive --store traces.db` (or an agl train run) keeps their rollouts. This trains on them
without running any harness or engine:

    end      a rollout without an end span (no agl.rollout around the harness) once it is quiet for
             offline.quiet_s
    select   complete, untrained rollouts of mode train with a reward, oldest first; drop (and record
             why) those that failed, are older than offline.max_age_s, or whose calls lag more than
             loop.staleness versions behind the weights being trained (unset: no bound; the loop's policy
             version: a new run starts at offline.policy_version, the version the store gives
             model.path's weights, and each step adds one); skip, unrecorded, those whose calls say a
             newer version (a later run may reach it)
    group    by task id (the GRPO group), groups of loop.group_size at most, offline.min_group_size
             at least (a task with fewer waits for more data)
    flat     loop.skip_flat_groups: a group whose rollouts all got one reward trains nothing: set aside
             (recorded), and the next groups fill the batch
    admit    a rollout the model cannot take (a non-finite reward, a token outside the vocabulary) is
             set aside with its reason, recorded (stored_checks.py); the rest of the step trains. A
             draw with nothing left to train is no step: the next is drawn
    train    loop.batch_rollouts a step. A token sampled by an older version than the weights being
             trained is stale: importance weights against the recorded engine logprobs
             (algorithms/token_age.py, as for live rollouts); staleness/* is measured against the
             loop's version
    record   at each checkpoint the step's rollouts are marked trained in the store (and in
             OUTPUT_DIR/trained.jsonl), so a second run, or --resume, continues where this one
             stopped and never trains a rollout twice (the loop's checkpoints, as for a live run)

The store is opened beside a running `agl receive` (SQLite WAL): new rollouts keep arriving; the
next step picks them up, reading only what changed since the last (store/cursor.py), and so does
the next run. The run ends when a draw finds nothing ready (or at loop.max_steps, loop.max_train_s).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from agl_trainer.algorithms.token_age import rollout_too_old, staleness_bound
from agl_trainer.batch import RolloutResult
from agl_trainer.config_schema import LoopConfig, OfflineConfig
from agl_trainer.loop.checkpoint import LoopState
from agl_trainer.loop.groups import FLAT_GROUP, is_flat
from agl_trainer.loop.ports import DataPlane, StepRecord
from agl_trainer.loop.progress import LoopProgress
from agl_trainer.loop.stored_checks import VERSION_AHEAD, split
from agl_trainer.store.cursor import StoreCursor
from agl_trainer.store.records import Cause, RolloutInfo, RolloutKey
from agl_trainer.store.rollout_store import RolloutStore


@dataclass
class Selection:
    groups: list[list[RolloutKey]]
    dropped: dict[str, list[RolloutKey]]
    waiting: int
    ahead: list[RolloutKey] = field(default_factory=list)  # newer than `current`: not recorded


def select(
    infos: list[RolloutInfo],
    min_versions: dict[RolloutKey, int],
    *,
    group_size: int,
    min_group_size: int,
    staleness: int,
    max_age_s: float,
    now: float,
    current: int,
    max_versions: dict[RolloutKey, int] | None = None,
) -> Selection:
    """Which ready rollouts to train (as groups, oldest first), which to drop and why, how many wait.
    `current`: the policy version of the weights being trained; a rollout's lag is current minus its
    oldest call's version (min_versions). One whose newest call (max_versions) is ahead of current
    is skipped, not recorded: one hostile version number never makes the others stale."""
    dropped: dict[str, list[RolloutKey]] = defaultdict(list)
    ahead: list[RolloutKey] = []
    by_task: dict[str, list[RolloutKey]] = defaultdict(list)
    waiting = 0
    ok = (None, Cause.OK.value)
    for info in infos:
        key = info.key
        if info.end_cause not in ok:
            dropped["failed"].append(key)
        elif max_age_s > 0 and (info.completed_at or info.last_span_at) < now - max_age_s:
            dropped["too_old"].append(key)
        elif (max_versions or {}).get(key, min_versions.get(key, current)) > current:
            ahead.append(key)
        elif rollout_too_old(min_versions.get(key, current), current, staleness):
            dropped["stale"].append(key)
        elif info.rewards == 0 or info.calls == 0:
            waiting += 1  # a reward (or the calls) may still arrive
        else:
            by_task[info.task_id or info.rollout_id].append(key)
    groups: list[list[RolloutKey]] = []
    for keys in by_task.values():
        for start in range(0, len(keys), group_size):
            chunk = keys[start : start + group_size]
            if len(chunk) >= min_group_size:
                groups.append(chunk)
            else:
                waiting += len(chunk)
    return Selection(groups, dict(dropped), waiting, ahead)


class StoredRollouts:
    has_engine = False
    steps_on_empty = False  # a draw the model can take nothing of: the next one is drawn

    def __init__(
        self,
        store: RolloutStore,
        store_path: Path,
        data: DataPlane,
        *,
        loop: LoopConfig,
        offline: OfflineConfig,
        vocab_size: int | None,
        progress: LoopProgress,
    ) -> None:
        self.cursor = StoreCursor(store, store_path)  # a step reads only what changed since the last
        self.data = data
        self.loop = loop
        self.offline = offline
        self.vocab_size = vocab_size  # tokens outside it are set aside, not trained
        self.progress = progress
        self.failures: dict[str, int] = {}  # nothing runs here: no rollout fails
        self.dropped: dict[str, int] = {}  # dropped or set aside (recorded in the store), by reason
        self.waiting = 0  # ready rollouts left for a later run (a group too small, no reward yet)
        self.ahead = 0  # skipped: their calls say a newer policy version than the weights trained
        self.set_aside_flat = 0  # loop.skip_flat_groups: rollouts in flat groups the last draw set aside
        self.staleness = staleness_bound(loop.staleness, live=False)
        if self.staleness >= 0:  # one knob for live and stored rollouts: say what it does to a store
            progress.log(
                f"agl: loop.staleness={self.staleness}: stored rollouts more than {self.staleness} versions behind "
                "the weights being trained are dropped (recorded as stale; -1: no bound)"
            )

    async def next_batch(self, version: int, step: StepRecord) -> list[RolloutKey] | None:
        batch = await asyncio.to_thread(self._draw, version)
        return batch or None

    def _draw(self, current: int) -> list[RolloutKey]:
        """The next step's rollouts, groups whole up to loop.batch_rollouts (store/cursor.py reads)."""
        infos = self.cursor.refresh(self.offline.quiet_s, time.time())
        selection = select(
            infos,
            self.cursor.min_versions,
            group_size=self.loop.group_size,
            min_group_size=self.offline.min_group_size,
            staleness=self.staleness,
            max_age_s=self.offline.max_age_s,
            now=time.time(),
            current=current,
            max_versions=self.cursor.max_versions,
        )
        self._set_aside(selection.dropped)
        self.cursor.forget(selection.ahead)  # not recorded: a later run, further on, may train them
        self.ahead += len(selection.ahead)
        self.waiting = selection.waiting
        batch: list[RolloutKey] = []
        flat: list[RolloutKey] = []
        for group in selection.groups:
            if len(batch) + len(group) > self.loop.batch_rollouts and batch:
                break
            found = self.data.group_rewards(group) if self.loop.skip_flat_groups else None
            if found is not None and is_flat(found.rewards):  # stored rollouts are drawn once rewarded
                flat += group  # trains nothing: recorded, and the next group takes its place
                continue
            batch += group
        self._set_aside({FLAT_GROUP: flat} if flat else {})
        self.set_aside_flat = len(flat)
        self.cursor.forget(batch)
        return batch

    def admit(self, results: list[RolloutResult], version: int, step: StepRecord) -> list[RolloutResult]:
        """Less the rollouts the model cannot take (set aside, recorded) and those whose tokens say a
        newer version (a token after a keep switch: skipped, as select skips such calls)."""
        good, bad = split(results, self.vocab_size, version)
        self.ahead += len(bad.pop(VERSION_AHEAD, []))
        self._set_aside(bad)
        if bad:
            counts = ", ".join(f"{len(keys)} {reason}" for reason, keys in sorted(bad.items()))
            self.progress.log(f"agl: set aside (recorded): {counts}")
        step.metrics["rollouts/set_aside"] = float(sum(len(v) for v in bad.values()))
        if self.loop.skip_flat_groups:
            step.metrics["rollouts/set_aside_flat"] = float(self.set_aside_flat)
        return good

    def _set_aside(self, dropped: dict[str, list[RolloutKey]]) -> None:
        for reason, keys in dropped.items():
            self.data.mark_dropped(keys, reason)  # recorded: the next run does not look at them again
            self.cursor.forget(keys)
            self.dropped[reason] = self.dropped.get(reason, 0) + len(keys)

    # nothing is generated: nothing to open, pause, publish or stop
    async def open(
        self, version: int, *, check: Callable[[], None], on_fatal: Callable[[BaseException], None]
    ) -> None:
        return None

    async def hold(self, version: int, step: StepRecord) -> None:
        return None

    async def while_training(self, train: Callable[[], Awaitable[None]], version: int, step: StepRecord) -> None:
        await train()

    def retire(self) -> None:
        return None  # the cursor forgot the batch when it was drawn

    def save(self, state: LoopState) -> None:
        return None

    async def publish(self, version: int, step: StepRecord) -> BaseException | None:
        return None

    async def stop(self) -> None:
        return None
