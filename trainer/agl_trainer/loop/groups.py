"""Which rollouts run: tasks in a seeded order, each as a group of `group_size` rollouts.

A group is the unit of launching and training: its rollouts share a task (the advantage baseline)
and the policy version it was launched under, which bounds how stale its calls can be. Every launch
is appended to a journal (groups.jsonl) before the rollouts start, so `--resume` knows every rollout
the previous run started, even those launched after its last checkpoint.

loop.revisit_mixed: a task whose trained group got mixed rewards (the groups that carry a signal) is
drawn again ahead of the seeded order, up to that many more times, so a step holds more of the tasks
at the edge of what the policy can do instead of tasks it always or never solves.
"""

from __future__ import annotations

import enum
import json
import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl import semconv
from agl_trainer.runners.base import Cause, RolloutOutcome, RolloutSpec
from agl_trainer.store.records import RolloutKey


class Member(str, enum.Enum):
    RUNNING = "running"  # harness running
    EXITED = "exited"  # harness ended well; waiting for the store to call the rollout complete
    COMPLETE = "complete"  # data complete in the store
    FAILED = "failed"  # harness error, timeout, or infrastructure failure after retries
    DROPPED = "dropped"  # cancelled by the loop (too stale, or shutdown)


DONE = (Member.COMPLETE, Member.FAILED, Member.DROPPED)

# loop.skip_flat_groups: the store's drop reason for a group set aside as flat
FLAT_GROUP = "flat group: every rollout got the same reward"


def is_flat(rewards: list[float]) -> bool:
    """Two or more rewards, all equal: every advantage in the group is 0, so it trains nothing."""
    # == rather than a set: NaN is never equal to itself (a set would match one NaN object to itself)
    return len(rewards) >= 2 and all(r == rewards[0] for r in rewards)


def is_mixed(rewards: list[float]) -> bool:
    """Two or more finite rewards, not all equal: a group whose advantages carry a signal."""
    finite = [r for r in rewards if math.isfinite(r)]
    return len(finite) >= 2 and not is_flat(finite)


@dataclass
class Group:
    index: int
    task: dict[str, Any]
    launched_version: int
    rollout_ids: list[str]
    states: dict[str, Member] = field(default_factory=dict)
    outcomes: dict[str, RolloutOutcome] = field(default_factory=dict)
    exited_at: dict[str, float] = field(default_factory=dict)
    mode: str = semconv.MODE_TRAIN
    revisit: bool = False  # drawn again for its mixed rewards (loop.revisit_mixed), not from the seeded order

    @property
    def task_id(self) -> str:
        return str(self.task["id"])

    def specs(self) -> list[RolloutSpec]:
        return [RolloutSpec(rid, self.task_id, self.task, 0, self.mode) for rid in self.rollout_ids]

    @property
    def done(self) -> bool:
        return all(self.states.get(rid) in DONE for rid in self.rollout_ids)

    def key(self, rollout_id: str) -> RolloutKey:
        """The store's name for a member: its id and the attempt that ran last (retries add one)."""
        outcome = self.outcomes.get(rollout_id)
        return RolloutKey(rollout_id, outcome.spec.attempt if outcome is not None else 0)

    def ids_in(self, *states: Member) -> list[str]:
        return [rid for rid in self.rollout_ids if self.states.get(rid) in states]

    def record_exit(self, outcome: RolloutOutcome, now: float) -> None:
        rid = outcome.spec.rollout_id
        if self.states.get(rid) in DONE:
            return
        self.outcomes[rid] = outcome
        if outcome.cause is Cause.OK:
            self.states[rid] = Member.EXITED
            self.exited_at[rid] = now
        elif outcome.cause is Cause.CANCELLED:
            self.states[rid] = Member.DROPPED
        else:
            self.states[rid] = Member.FAILED

    def to_json(self) -> dict[str, Any]:
        entry = {
            "index": self.index,
            "task_id": self.task_id,
            "version": self.launched_version,
            "rollout_ids": self.rollout_ids,
            "mode": self.mode,
        }
        if self.revisit:
            entry["revisit"] = True
        return entry


class TaskSchedule:
    """An endless, seeded stream of groups over the tasks: each epoch is a fresh shuffle; with
    `revisits`, tasks queued by `revisit` go first."""

    def __init__(
        self, tasks: list[dict[str, Any]], group_size: int, seed: int, run_id: str, revisits: int = 0
    ) -> None:
        self.tasks = tasks
        self.group_size = group_size
        self.seed = seed
        self.run_id = run_id
        self.revisits = revisits
        self.next_index = 0  # groups launched (the journal's index)
        self.fresh_index = 0  # of those, drawn from the seeded order
        self.queued: deque[dict[str, Any]] = deque()
        self.revisited: Counter[str] = Counter()  # task id -> groups drawn again for it

    def revisit(self, task: dict[str, Any]) -> bool:
        """Queue `task` for one more group unless it has had `revisits` already; whether it was queued."""
        task_id = str(task["id"])
        if self.revisited[task_id] >= self.revisits:
            return False
        self.revisited[task_id] += 1
        self.queued.append(task)
        return True

    def resume(self, entries: list[dict[str, Any]], next_index: int) -> None:
        """Continue after the groups a journal records (one entry per index); the queue itself is not
        recorded: tasks queued and not yet launched by the previous run are not revisited."""
        self.next_index = max([e["index"] + 1 for e in entries], default=next_index)
        again = [str(e["task_id"]) for e in entries if e.get("revisit")]
        self.fresh_index = self.next_index - len(again)
        self.revisited = Counter(again)

    def task_for(self, index: int) -> dict[str, Any]:
        epoch, position = divmod(index, len(self.tasks))
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return self.tasks[order[position]]

    def next_group(self, version: int, mode: str = semconv.MODE_TRAIN) -> Group:
        index = self.next_index
        self.next_index += 1
        revisit = bool(self.queued)
        if revisit:
            task = self.queued.popleft()
        else:
            task = self.task_for(self.fresh_index)
            self.fresh_index += 1
        ids = [f"{self.run_id}-g{index:06d}-{member}" for member in range(self.group_size)]
        group = Group(index, task, version, ids, mode=mode, revisit=revisit)
        group.states = {rid: Member.RUNNING for rid in ids}
        return group


class GroupJournal:
    """Append-only record of launched groups (one JSON line each, flushed before launch)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(path, "a", encoding="utf-8")

    def append(self, group: Group) -> None:
        self._handle.write(json.dumps(group.to_json()) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        if not path.exists():
            return []
        entries = []
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a line cut short by a crash: nothing after it was launched
        return entries
