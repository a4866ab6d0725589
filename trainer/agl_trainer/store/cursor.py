"""What `agl train --from-store` reads from the store each step: only what changed since the last step.

The store only adds rollout and call rows, and a rollout row only moves one way (in flight, complete,
then trained or dropped). So `StoreCursor` keeps the last rollout row and call row it read, the
rollouts then in flight, and the ready rollouts it has not handed out yet (the pool); a step reads

    the rollout rows added since            by rowid
    the rollouts in flight                  through the completion index: as many as are in flight
    the ready ones still without a reward   by key: a reward may still come (one naming no attempt
                                            touches no rollout row, so nothing else says it came)
    the call rows added since               by rowid: each rollout's oldest policy version

and hands `select` the pool, oldest completion first, as RolloutStore.ready_rollouts orders it.
`FullScan` is what a step read before (every rollout, every ready one, every call): the reference
the equivalence test and bench/from_store.py measure the cursor against.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from agl import semconv

from agl_trainer.store.queries import call_versions, call_versions_since
from agl_trainer.store.records import RolloutInfo, RolloutKey
from agl_trainer.store.rollout_store import RolloutStore


def close_quiet_among(store: RolloutStore, infos: Iterable[RolloutInfo], quiet_s: float, now: float) -> int:
    """Rollouts with no end span (a harness without agl.rollout around it) end once quiet for `quiet_s`:
    recorded as if their harness exited cleanly, so they complete and can be trained."""
    closed = 0
    for info in infos:
        mode = info.mode or semconv.MODE_TRAIN
        if info.complete or mode != semconv.MODE_TRAIN or info.last_span_at > now - quiet_s:
            continue
        store.mark_harness_exited(info.rollout_id, 0, attempt=info.attempt)
        closed += 1
    return closed


def _order(info: RolloutInfo) -> tuple[float, float, str, int]:
    return (info.completed_at or 0.0, info.first_seen_at, info.rollout_id, info.attempt)


class StoreCursor:
    def __init__(self, store: RolloutStore, store_path: Path) -> None:
        self.store = store
        self.store_path = store_path
        self.min_versions: dict[RolloutKey, int] = {}  # each rollout's oldest call version
        self.max_versions: dict[RolloutKey, int] = {}  # and its newest (ahead of the trained weights: skipped)
        self.newest = 0  # the newest of the oldest versions (reported; select measures against the run's)
        self.rows_read = 0  # rollout rows the last refresh read (the tests and the bench look here)
        self._row = 0
        self._call_row = 0
        self._open: set[RolloutKey] = set()
        self._pool: dict[RolloutKey, RolloutInfo] = {}  # oldest completion first, kept so (no sort a step)
        self._tail: tuple[float, float, str, int] | None = None  # no pool entry orders after this
        self._unrewarded: set[RolloutKey] = set()  # in the pool without a reward (or a call) yet
        self._gone: set[RolloutKey] = set()  # handed out or dropped by this run

    def refresh(self, quiet_s: float, now: float) -> list[RolloutInfo]:
        """Read what changed; the ready rollouts not handed out yet, oldest completion first."""
        upto = self.store.last_row()  # first: a row added after it is read next time
        incomplete = self.store.incomplete_rollouts()
        self.rows_read = len(incomplete)
        if close_quiet_among(self.store, incomplete, quiet_s, now):
            incomplete = self.store.incomplete_rollouts()
            self.rows_read += len(incomplete)
        still_open = {i.key for i in incomplete}
        recheck = (self._open - still_open) | self._unrewarded
        found = self.store.ready_among(recheck, after_row=self._row, upto_row=upto)
        self.rows_read += len(found)
        self._add({i.key: i for i in found if i.key not in self._gone}, recheck)
        self._open, self._row = still_open, upto
        self._read_versions()
        return list(self._pool.values())

    def _add(self, found: dict[RolloutKey, RolloutInfo], recheck: set[RolloutKey]) -> None:
        for key in recheck - found.keys():
            self._pool.pop(key, None)  # no longer ready (marked by someone else)
            self._unrewarded.discard(key)
        new: list[RolloutInfo] = []
        for key, info in found.items():
            if key in self._pool:
                self._pool[key] = info  # in place: a rollout's place in the order does not change
            else:
                new.append(info)
            if info.rewards and info.calls:
                self._unrewarded.discard(key)
            else:
                self._unrewarded.add(key)
        if not new:
            return
        new.sort(key=_order)
        if self._tail is not None and _order(new[0]) < self._tail:  # one completed before the newest known
            merged = sorted([*self._pool.values(), *new], key=_order)
            self._pool = {i.key: i for i in merged}
        else:
            self._pool.update((i.key, i) for i in new)
        self._tail = max(self._tail or _order(new[-1]), _order(new[-1]))

    def forget(self, keys: Iterable[RolloutKey]) -> None:
        """These were trained or dropped: never hand them out again."""
        for key in keys:
            self._pool.pop(key, None)
            self._unrewarded.discard(key)
            self._gone.add(key)

    def _read_versions(self) -> None:
        rows = call_versions_since(self.store_path, self._call_row)
        lowered = False  # a rollout's oldest version went down: the newest among them may have too
        for row, rollout_id, attempt, version in rows:
            key, version = RolloutKey(rollout_id, attempt), int(version)
            self.max_versions[key] = max(version, self.max_versions.get(key, version))
            old = self.min_versions.get(key)
            if old is None:
                self.min_versions[key] = version
                self.newest = max(self.newest, version)
            elif version < old:
                self.min_versions[key] = version
                lowered |= old == self.newest
            self._call_row = row
        if lowered:
            self.newest = max(self.min_versions.values(), default=0)


class FullScan:
    """The reference: every step reads every rollout (quiet ones), every ready one and every call."""

    def __init__(self, store: RolloutStore, store_path: Path) -> None:
        self.store = store
        self.store_path = store_path
        self.min_versions: dict[RolloutKey, int] = {}
        self.max_versions: dict[RolloutKey, int] = {}
        self.newest = 0
        self.rows_read = 0
        self._gone: set[RolloutKey] = set()

    def refresh(self, quiet_s: float, now: float) -> list[RolloutInfo]:
        every = self.store.rollouts()
        close_quiet_among(self.store, every, quiet_s, now)
        ready = self.store.ready_rollouts(semconv.MODE_TRAIN)
        self.rows_read = len(every) + len(ready)
        self.min_versions = call_versions(self.store_path)
        self.max_versions = call_versions(self.store_path, newest=True)
        self.newest = max(self.min_versions.values(), default=0)
        return [i for i in ready if i.key not in self._gone]

    def forget(self, keys: Iterable[RolloutKey]) -> None:
        self._gone.update(keys)

