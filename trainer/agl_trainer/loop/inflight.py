"""The rollouts in flight: which groups are launched, when complete groups make a batch, and what a
rollout's end means for its group.

    launch        a group of loop.group_size rollouts of the next task, journalled before any
                  harness starts; async mode launches while in-flight rollouts stay under
                  loop.concurrency and launched-but-untrained ones under (staleness + 1) batches
                  (stale_policy=mask: loop.max_span batches: a group may train that late)
    complete      a member whose harness exited is complete once the store says so; one that
                  exited well but whose data never arrived is failed (no_data)
    flat          loop.skip_flat_groups: a complete group whose rollouts all got one reward (every
                  advantage 0) is set aside, recorded as dropped, and leaves: launching refills its
                  place (async) or the sync batch relaunches as many; at most loop.flat_skip_limit
                  batches' worth a step, then flat groups train as they come
    batch         complete groups, oldest first (loop.oldest_first; else in the order they
                  completed), once they hold loop.batch_rollouts; groups that would be too stale
                  after the update (launched under v <= version - staleness) go into it: with
                  stale_policy=wait the batch waits for them, with drop they are killed; with mask
                  no step waits for a running group: it runs on across updates (its tokens past the
                  bound get no loss, core.py) until its loop.max_span-th update, where it is killed
    retire        groups trained (or dropped) leave

The loop (core.py) asks; this unit keeps the groups and the harness tasks and counts failures by
cause. A harness that cannot be found at all ends the run through `on_fatal`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from agl_trainer.algorithms.token_age import staleness_bound
from agl_trainer.config import ConfigError, LoopConfig
from agl_trainer.loop.groups import (
    DONE, FLAT_GROUP, Group, GroupJournal, Member, TaskSchedule, is_flat, is_mixed,
)  # fmt: skip
from agl_trainer.loop.ports import DataPlane
from agl_trainer.loop.progress import LoopProgress
from agl_trainer.runners.base import Cause, HarnessNotFound, RolloutOutcome, Runner
from agl_trainer.store.records import RolloutKey

log = logging.getLogger("agl.loop")

NO_DATA_AFTER_EXIT_S = 60.0  # a harness exited well but the store never completed its rollout
# loop.skip_flat_groups: a complete group waits this long for its rewards (a grader's comes through the
# sidecar's span export, after the harness ended) before it is judged on those it has
REWARD_WAIT_S = 10.0


class InFlight:
    def __init__(
        self,
        config: LoopConfig,
        *,
        schedule: TaskSchedule,
        runner: Runner,
        journal: GroupJournal,
        data: DataPlane,
        progress: LoopProgress,
        on_fatal: Callable[[BaseException], None] = lambda error: None,
    ) -> None:
        self.config = config
        self.staleness = staleness_bound(config.staleness, live=True)  # versions a trained token may lag
        if self.staleness < 0:
            raise ConfigError(
                "loop.staleness -1 (no bound) is for --from-store runs: a live run launches at most "
                "staleness + 1 batches ahead (fix: set loop.staleness to 0 or more, or leave it unset: 1)"
            )
        self.schedule = schedule
        self.runner = runner
        self.journal = journal
        self.data = data
        self.progress = progress
        self.on_fatal = on_fatal  # the live source (live.py) sets its own
        self.groups: dict[int, Group] = {}  # launched, not yet trained or dropped
        self.tasks: dict[str, asyncio.Task[RolloutOutcome]] = {}  # the harnesses running, by rollout id
        self.failures: dict[str, int] = {}  # cause -> count, over the run
        self.flat_set_aside = 0  # rollouts in flat groups set aside since the last trained batch
        self._judged: set[int] = set()  # complete groups found not flat (or kept past the limit)
        self._done_at: dict[int, float] = {}  # undecided groups: when first seen complete
        self._said_flat_limit = False

    # --- launching -----------------------------------------------------------------------------
    def launch(self, version: int) -> Group:
        group = self.schedule.next_group(version)
        self.journal.append(group)  # on disk before any harness starts
        self.groups[group.index] = group
        for spec in group.specs():
            self._start(group, spec)
        return group

    def launch_what_fits(self, version: int) -> None:
        size = self.config.group_size
        # Launched and untrained: at most the batches that may train before a group breaks its bound
        # (staleness + 1 steps; with stale_policy=mask, loop.max_span steps).
        batches = self.config.max_span if self.config.stale_policy == "mask" else self.staleness + 1
        cap = batches * self.config.batch_rollouts
        while True:
            untrained = sum(len(g.rollout_ids) for g in self.groups.values())
            if self.running() + size > max(self.config.concurrency, size) or untrained + size > cap:
                return
            if self._waits(version):
                return  # groups that must be trained next are still running: more would only compete
            self.launch(version)

    def adopt(self, group: Group, version: int, step: int) -> None:
        """Track a group launched before a restart; relaunch members that did not complete (under
        new ids: the old ones may have partial data in the store)."""
        self.groups[group.index] = group
        relaunch = [rid for rid in group.rollout_ids if group.states.get(rid) is Member.RUNNING]
        if not relaunch:
            return
        for rid in relaunch:
            new_id = f"{rid}-r{step}"
            group.rollout_ids[group.rollout_ids.index(rid)] = new_id
            del group.states[rid]
            group.states[new_id] = Member.RUNNING
            self.data.mark_dropped([RolloutKey(rid, 0)], "relaunched after restart")
        group.launched_version = min(group.launched_version, version)
        self.journal.append(group)
        for spec in group.specs():
            if spec.rollout_id in relaunch or group.states.get(spec.rollout_id) is not Member.RUNNING:
                continue
            self._start(group, spec)

    def running(self) -> int:
        """Members whose harness runs, or exited and waits for the store."""
        return sum(len(g.ids_in(Member.RUNNING, Member.EXITED)) for g in self.groups.values())

    # --- batches -------------------------------------------------------------------------------
    def must_wait_for(self, version: int) -> list[Group]:
        """Groups that must be in the next batch: after the update they would be too stale."""
        # Trained after this update (at version + 1 or later), a group launched under v lags by
        # at least version + 1 - v: it must be trained now when that would exceed the bound.
        return [g for g in self.groups.values() if g.launched_version <= version - self.staleness]

    def ready_batch(self, version: int) -> list[Group] | None:
        done = sorted((g for g in self.groups.values() if g.done), key=self._batch_order)
        complete, undecided = self.set_aside_flat(done)
        ready = sum(len(g.rollout_ids) for g in complete)
        self.progress.rollouts(min(ready, self.config.batch_rollouts), self.running())
        if ready < self.config.batch_rollouts:
            return None
        must = self.must_wait_for(version)  # complete ones train now, past batch_rollouts if need be
        if self._waits(version) or any(g in undecided for g in must):
            return None
        batch: list[Group] = []
        count = 0
        for group in complete:
            if count >= self.config.batch_rollouts and group not in must:
                continue
            batch.append(group)
            count += len(group.rollout_ids)
        return batch

    def trainable_keys(self, batch: list[Group]) -> list[RolloutKey]:
        states = (Member.COMPLETE, Member.FAILED) if self.config.failed_rollouts == "zero" else (Member.COMPLETE,)
        return [group.key(rid) for group in batch for rid in group.ids_in(*states)]

    def retire(self, batch: list[Group]) -> None:
        for group in batch:
            self.groups.pop(group.index, None)
            self._judged.discard(group.index)
            if self.config.revisit_mixed:
                self._revisit_if_mixed(group)
        self.flat_set_aside, self._said_flat_limit = 0, False

    def _revisit_if_mixed(self, group: Group) -> None:
        """loop.revisit_mixed: a trained group whose rewards differed draws its task again."""
        found = self.data.group_rewards([group.key(rid) for rid in group.ids_in(Member.COMPLETE)])
        if found is None:  # per-call rewards: no group reward to judge
            return
        if is_mixed(self._as_trained(group, found.rewards)):
            self.schedule.revisit(group.task)

    def _as_trained(self, group: Group, rewards: list[float]) -> list[float]:
        """The complete members' `rewards`, and a 0.0 for each failed one under loop.failed_rollouts=zero
        (it trains at 0): the rewards a group's advantages come from."""
        if self.config.failed_rollouts == "zero":
            return rewards + [0.0] * len(group.ids_in(Member.FAILED))
        return rewards

    # --- flat groups (loop.skip_flat_groups) ---------------------------------------------------
    def set_aside_flat(self, groups: list[Group]) -> tuple[list[Group], list[Group]]:
        """`groups` less the complete ones whose rollouts all got one reward, which leave (recorded as
        dropped, FLAT_GROUP), up to loop.flat_skip_limit batches' worth since the last trained batch;
        and apart, the complete ones still awaiting a reward (undecided: not ready to train yet)."""
        if not self.config.skip_flat_groups:
            return groups, []
        kept: list[Group] = []
        undecided: list[Group] = []
        now = time.monotonic()
        for group in groups:
            if group.index in self._judged or not group.done:
                kept.append(group)
                continue
            found = self.data.group_rewards([group.key(rid) for rid in group.ids_in(Member.COMPLETE)])
            waited = now - self._done_at.setdefault(group.index, now)
            if found is not None and found.awaited and waited < REWARD_WAIT_S:
                undecided.append(group)  # judged on rewards that are not all in yet, it might look flat or not
                continue
            self._done_at.pop(group.index, None)
            self._judged.add(group.index)
            # None: per-call rewards, never flat
            rewards = self._as_trained(group, [] if found is None else found.rewards)
            if not is_flat(rewards) or self._past_flat_limit():
                kept.append(group)
                continue
            self.data.mark_dropped([group.key(rid) for rid in group.rollout_ids], FLAT_GROUP)
            self.groups.pop(group.index, None)
            self.flat_set_aside += len(group.rollout_ids)
        return kept, undecided

    def _past_flat_limit(self) -> bool:
        limit = self.config.flat_skip_limit * self.config.batch_rollouts
        if not limit or self.flat_set_aside < limit:
            return False
        if not self._said_flat_limit:
            self._said_flat_limit = True
            self.progress.log(
                f"agl: loop.flat_skip_limit={self.config.flat_skip_limit}: {self.flat_set_aside} rollouts "
                "in flat groups set aside since the last step; until the next step they train as they come "
                "(every reward in a group equal: the tasks may be too easy or too hard for the policy)"
            )
        return True

    # --- ends ----------------------------------------------------------------------------------
    def poll_completion(self) -> None:
        waiting = {g.key(rid): (rid, g) for g in self.groups.values() for rid in g.ids_in(Member.EXITED)}
        if not waiting:
            return
        complete = self.data.complete(list(waiting))
        now = time.monotonic()
        for key, (rid, group) in waiting.items():
            if key in complete:
                group.states[rid] = Member.COMPLETE
            elif now - group.exited_at.get(rid, now) > NO_DATA_AFTER_EXIT_S + self.config.completion_grace_s:
                group.states[rid] = Member.FAILED
                self.count("no_data")
                self.progress.log(f"agl: rollout {rid}: harness exited but no complete data arrived; skipped")

    def _batch_order(self, group: Group) -> tuple[float, int]:
        """loop.oldest_first: by launch (the long rollouts, launched earliest, first); else by when
        the group's last member ended (a member with no end time, failed at launch, counts as 0)."""
        if self.config.oldest_first:
            return (0.0, group.index)
        return (max(group.exited_at.values(), default=0.0), group.index)

    def _waits(self, version: int) -> bool:
        return self.config.stale_policy == "wait" and any(not g.done for g in self.must_wait_for(version))

    def overdue(self, version: int) -> list[Group]:
        """Running groups the update from `version` ends: past the staleness bound (stale_policy=drop)
        or at their loop.max_span-th update since launch (mask); none for wait."""
        policy = self.config.stale_policy
        if policy == "drop":
            groups = self.must_wait_for(version)
        elif policy == "mask":  # after this update a group launched under v has run across version + 1 - v
            groups = [g for g in self.groups.values() if version + 1 - g.launched_version >= self.config.max_span]
        else:
            groups = []
        return [g for g in groups if not g.done]

    async def drop_overdue(self, version: int, exclude: list[Group]) -> int:
        """Kill the groups `overdue` names (not those in the batch); how many rollouts."""
        keep = {g.index for g in exclude}
        dropped = 0
        for group in [g for g in self.overdue(version) if g.index not in keep]:
            for rid in group.rollout_ids:
                task = self.tasks.get(rid)
                if task is not None:
                    task.cancel()
            await asyncio.gather(*(self.tasks[r] for r in group.rollout_ids if r in self.tasks), return_exceptions=True)
            for rid in group.rollout_ids:
                if group.states.get(rid) not in DONE:
                    group.states[rid] = Member.DROPPED
            reason = "stale" if self.config.stale_policy == "drop" else f"over loop.max_span={self.config.max_span}"
            self.data.mark_dropped([group.key(rid) for rid in group.rollout_ids], reason)
            dropped += len(group.rollout_ids)
            self.groups.pop(group.index, None)
        return dropped

    async def cancel_all(self) -> None:
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.tasks.clear()

    def count(self, cause: str) -> None:
        self.failures[cause] = self.failures.get(cause, 0) + 1

    def _start(self, group: Group, spec: Any) -> None:
        task = asyncio.create_task(self.runner.run(spec), name=spec.rollout_id)
        task.add_done_callback(lambda t, g=group: self._on_done(g, t))
        self.tasks[spec.rollout_id] = task

    def _on_done(self, group: Group, task: asyncio.Task[RolloutOutcome]) -> None:
        rollout_id = task.get_name()
        self.tasks.pop(rollout_id, None)
        if task.cancelled():
            group.states[rollout_id] = Member.DROPPED
            return
        error = task.exception()
        if isinstance(error, HarnessNotFound):
            self.on_fatal(error)  # no rollout can run: stop with the message
            return
        if error is not None:
            log.error("runner failed on %s: %r", rollout_id, error)
            group.states[rollout_id] = Member.FAILED
            self.count(Cause.INFRA_ERROR.value)
            return
        outcome = task.result()
        group.record_exit(outcome, time.monotonic())
        if not outcome.ok:
            self.count(outcome.cause.value)
            self.progress.log(
                f"agl: rollout {rollout_id} (task {group.task_id}) {outcome.cause.value}: {outcome.message}"
                + (f" (log: {outcome.log_path})" if outcome.log_path else "")
            )
