"""`RolloutStore`: the SQLite file that holds every span the trainer received and what it trained on.

Durability: the database is in WAL mode. With `durability="full"` (the default, SQLite
`synchronous=FULL`) a committed write has been fsynced to the WAL before `write()` returns, so it
survives a process crash (SIGKILL) and a power loss or OS crash. With `durability="normal"`
(`synchronous=NORMAL`) commits survive a process crash, but the last transactions before a power
loss may be rolled back (the database stays consistent). The receiver answers 200 only after the
commit returns.

One instance is one connection; use one per thread (the receiver has its own writer thread, the
training loop its own). SQLite's WAL lets readers run while the writer writes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Self

from agl import semconv

from agl_trainer.store.records import (
    CAUSES,
    CallSpan,
    Cause,
    Record,
    RewardRow,
    RewardSpan,
    RolloutData,
    RolloutInfo,
    RolloutKey,
    RolloutSpan,
    StoreStats,
    Violation,
    WriteResult,
    final_reward,
)
from agl_trainer.store import queries
from agl_trainer.store.schema import MIGRATIONS, SCHEMA, SCHEMA_VERSION

if TYPE_CHECKING:  # numpy is imported where token arrays are read or written: listing needs none
    import numpy as np

log = logging.getLogger("agl.store")

DURABILITY = {"full": "FULL", "normal": "NORMAL"}
DEFAULT_GRACE_S = 2.0

_INFO_COLUMNS = (
    "rollout_id, attempt, task_id, mode, status, complete, end_cause, first_seen_at, last_span_at,"
    " completed_at, trained_step, dropped_reason,"
    " (SELECT COUNT(*) FROM calls c WHERE c.rollout_id = r.rollout_id AND c.attempt = r.attempt),"
    " (SELECT COUNT(*) FROM rewards w WHERE w.rollout_id = r.rollout_id"
    "   AND (w.attempt IS NULL OR w.attempt = r.attempt)),"
    " error, harness_exit_code, late_spans"
)


class StoreError(Exception):
    """The store file cannot be used (not an agl store, newer schema, bad argument)."""


def _blob(array: np.ndarray | None, dtype: str) -> bytes | None:
    import numpy as np

    return None if array is None else np.ascontiguousarray(array, dtype=dtype).tobytes()


def _text_list(entries: Sequence[str]) -> str | None:
    """A list of strings as its column holds it: a JSON array, NULL when empty (queries reads it)."""
    return json.dumps(list(entries), ensure_ascii=False) if entries else None


class RolloutStore:
    """The rollout store at `path` (created if missing). See the package docstring for the API."""

    def __init__(
        self,
        path: str | Path,
        *,
        durability: str = "full",
        grace_s: float = DEFAULT_GRACE_S,
        rollout_timeout_s: float | None = None,
        clock: Callable[[], float] = time.time,
        busy_timeout_s: float = 60.0,
    ) -> None:
        if durability not in DURABILITY:
            raise StoreError(f"durability must be one of {sorted(DURABILITY)}, got {durability!r}")
        if grace_s < 0:
            raise StoreError(f"grace_s must be >= 0, got {grace_s}")
        if rollout_timeout_s is not None and rollout_timeout_s <= 0:
            raise StoreError(f"rollout_timeout_s must be > 0 or None, got {rollout_timeout_s}")
        self.path = Path(path)
        self.grace_s = grace_s
        self.rollout_timeout_s = rollout_timeout_s
        self.clock = clock
        self._lock = threading.RLock()
        # busy_timeout_s: how long a write waits for another connection's write lock before failing.
        try:  # a folder, a path under a file, a file this user may not read: named, not a traceback
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(
                self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
        except (OSError, sqlite3.Error) as error:
            raise StoreError(f"{self.path} cannot be opened as a rollout store: {error}") from None
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={DURABILITY[durability]}")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as error:
            self._db.close()
            raise StoreError(f"{self.path} is not an agl rollout store: {error}") from None
        if version > SCHEMA_VERSION:
            self._db.close()
            raise StoreError(f"{self.path} has schema {version}; this agl reads up to {SCHEMA_VERSION}")
        if version < SCHEMA_VERSION:
            self._create_or_upgrade(version)

    def _create_or_upgrade(self, version: int) -> None:
        """A new store gets the schema, an older one is upgraded in place. Two processes opening the
        same store at once both try; the second finds the work done (its ALTER or CREATE fails once
        the first has committed) and goes on with the store as the first left it."""
        if version == 0:
            steps = f"{SCHEMA};"
        else:
            steps = " ".join(MIGRATIONS[v] for v in range(version + 1, SCHEMA_VERSION + 1))
        try:
            self._db.executescript(f"BEGIN IMMEDIATE; {steps} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
        except sqlite3.OperationalError:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            if self._db.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
                self._db.close()
                raise

    # --- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; BEGIN IMMEDIATE takes the write lock up front (or fails after
        busy_timeout_s), so a commit never fails half-way for lock reasons."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # SQLite rolls back by itself on some errors (SQLITE_FULL)
                    self._db.execute("ROLLBACK")
                raise

    # --- ingest -------------------------------------------------------------------------------
    def write(self, records: Iterable[Record]) -> WriteResult:
        """Store records in one transaction; a span already stored (trace id, span id) is skipped."""
        return self.write_batches([records])[0]

    def write_batches(self, batches: Sequence[Iterable[Record]]) -> list[WriteResult]:
        """Store several requests' records in one transaction (one fsync), a result for each.

        Records are range-checked before they get here (receiver/contract.py), so a value SQLite
        refuses is a bug; should one slip through anyway, it must cost no other request: the group
        is written again one request per transaction, and a request that still fails record by
        record, the refused record kept as a `store_rejected` violation. Errors of the store itself
        (disk full, I/O, lock timeout) are raised: nothing of the group was written."""
        batches = [list(records) for records in batches]
        now = self.clock()
        try:
            with self._transaction() as db:
                return [self._write_records(db, records, now) for records in batches]
        except _DATA_ERRORS as error:
            log.error("a record the store refused broke a group commit (%r); writing its requests apart", error)
        return [self._write_alone(records, now) for records in batches]

    def _write_alone(self, records: list[Record], now: float) -> WriteResult:
        try:
            with self._transaction() as db:
                return self._write_records(db, records, now)
        except _DATA_ERRORS:
            pass
        with self._transaction() as db:
            result = WriteResult(violations={})
            for record in records:
                db.execute("SAVEPOINT agl_record")
                try:
                    self._write_record(db, record, now, result)
                except _DATA_ERRORS as error:
                    db.execute("ROLLBACK TO agl_record")
                    log.error("the store refused a span (%r); kept as a store_rejected violation", error)
                    self._write_record(db, _rejected(record), now, result)
                db.execute("RELEASE agl_record")
            return result

    def _write_records(self, db: sqlite3.Connection, records: list[Record], now: float) -> WriteResult:
        result = WriteResult(violations={})
        for record in records:
            self._write_record(db, record, now, result)
        return result

    def _write_record(self, db: sqlite3.Connection, record: Record, now: float, result: WriteResult) -> None:
        if isinstance(record, CallSpan):
            inserted = self._insert_call(db, record, now)
            if inserted:
                result.tokens += _size(record.prompt_ids) + _size(record.completion_ids)
        elif isinstance(record, RewardSpan):
            inserted = self._insert_reward(db, record, now)
        elif isinstance(record, RolloutSpan):
            inserted = self._insert_rollout_span(db, record, now)
        else:
            inserted = self._insert_violation(db, record, now)
            if inserted:
                result.violations[record.reason] = result.violations.get(record.reason, 0) + 1
        if inserted:
            result.stored += 1
        else:
            result.duplicates += 1

    def _touch_rollout(
        self,
        db: sqlite3.Connection,
        rollout_id: str,
        attempt: int,
        task_id: str | None,
        mode: str | None,
        now: float,
        span: bool = True,
    ) -> None:
        db.execute(
            "INSERT INTO rollouts (rollout_id, attempt, task_id, mode, first_seen_at, last_span_at)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (rollout_id, attempt) DO UPDATE SET"
            " task_id = COALESCE(rollouts.task_id, excluded.task_id),"
            " mode = COALESCE(rollouts.mode, excluded.mode),"
            " last_span_at = excluded.last_span_at,"
            " late_spans = rollouts.late_spans + (rollouts.complete AND ?)",
            (rollout_id, attempt, task_id, mode, now, now, span),
        )

    def _insert_call(self, db: sqlite3.Connection, r: CallSpan, now: float) -> bool:
        cursor = db.execute(
            "INSERT OR IGNORE INTO calls VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                r.trace_id,
                r.span_id,
                r.rollout_id,
                r.attempt,
                r.call_seq,
                r.name,
                r.start_ns,
                r.end_ns,
                _blob(r.prompt_ids, "<i4"),
                _blob(r.completion_ids, "<i4"),
                _blob(r.logprobs, "<f4"),
                r.prompt_ref_seq,
                r.prompt_ref_length,
                r.prompt_length,
                r.policy_version,
                r.finish_reason,
                r.end_reason,
                r.tokens_source,
                r.choices,
                r.status_code,
                now,
                r.origin,
                r.parent_span_id,
                _blob(r.policy_versions, "<i8"),
                r.held_ms,
                r.upstream,
                r.api,
                r.agent_id,
                r.parent_agent_id,
                r.compaction,
                _text_list(r.fields_dropped),
                _text_list(r.fields_passed),
            ),
        )
        if cursor.rowcount:
            self._touch_rollout(db, r.rollout_id, r.attempt, r.task_id, r.mode, now)
        return cursor.rowcount > 0

    def _insert_reward(self, db: sqlite3.Connection, r: RewardSpan, now: float) -> bool:
        cursor = db.execute(
            "INSERT OR IGNORE INTO rewards VALUES (?,?,?,?,?,?,?,?,?)",
            (r.trace_id, r.span_id, r.rollout_id, r.attempt, r.name, r.value, r.call_seq, r.end_ns, now),
        )
        if cursor.rowcount and r.attempt is not None:
            self._touch_rollout(db, r.rollout_id, r.attempt, r.task_id, None, now)
        return cursor.rowcount > 0

    def _insert_rollout_span(self, db: sqlite3.Connection, r: RolloutSpan, now: float) -> bool:
        cursor = db.execute(
            "INSERT OR IGNORE INTO rollout_spans VALUES (?,?,?,?)",
            (r.trace_id, r.span_id, r.rollout_id, r.attempt),
        )
        if not cursor.rowcount:
            return False
        self._touch_rollout(db, r.rollout_id, r.attempt, r.task_id, r.mode, now)
        db.execute(
            "UPDATE rollouts SET status = ?, error = ?, started_ns = ?, ended_ns = ?, rollout_span_at = ?,"
            " task_id = COALESCE(task_id, ?), mode = COALESCE(?, mode)"
            " WHERE rollout_id = ? AND attempt = ?",
            (r.status, r.error, r.start_ns, r.end_ns, now, r.task_id, r.mode, r.rollout_id, r.attempt),
        )
        return True

    def _insert_violation(self, db: sqlite3.Connection, v: Violation, now: float) -> bool:
        cursor = db.execute(
            "INSERT OR IGNORE INTO violations VALUES (?,?,?,?,?,?)",
            (v.trace_id, v.span_id, v.name, v.reason, v.rollout_id, now),
        )
        return cursor.rowcount > 0

    # --- completion ---------------------------------------------------------------------------
    def mark_harness_exited(
        self, rollout_id: str, exit_code: int | None, cause: Cause | str | None = None, *, attempt: int = 0
    ) -> None:
        """The runner reports that the harness of a rollout exited. The rollout completes after the
        grace period (late spans still arrive). `cause` overrides the cause the exit code implies
        (0: ok, else harness_error), e.g. `infrastructure_error` when the runner itself failed."""
        if cause is not None and cause not in CAUSES:
            raise StoreError(f"cause must be one of {CAUSES}, got {cause!r}")
        cause = None if cause is None else Cause(cause).value  # a Cause or its spelling
        now = self.clock()
        with self._transaction() as db:
            self._touch_rollout(db, rollout_id, attempt, None, None, now, span=False)
            db.execute(
                "UPDATE rollouts SET harness_exited_at = ?, harness_exit_code = ?, harness_cause = ?"
                " WHERE rollout_id = ? AND attempt = ?",
                (now, exit_code, cause, rollout_id, attempt),
            )

    def refresh_completion(self) -> int:
        """Complete the rollouts whose end is due now; returns how many completed."""
        now = self.clock()
        grace_due = now - self.grace_s
        changed = 0
        with self._transaction() as db:
            changed += db.execute(
                "UPDATE rollouts SET complete = 1, completed_at = ?, end_cause = COALESCE(harness_cause, CASE"
                " WHEN status = ? THEN ? ELSE ? END)"
                " WHERE complete = 0 AND rollout_span_at IS NOT NULL AND rollout_span_at <= ?",
                (now, semconv.STATUS_FAILED, Cause.HARNESS_ERROR.value, Cause.OK.value, grace_due),
            ).rowcount
            changed += db.execute(
                "UPDATE rollouts SET complete = 1, completed_at = ?, end_cause = COALESCE(harness_cause, CASE"
                " WHEN harness_exit_code = 0 THEN ? WHEN harness_exit_code IS NULL THEN ? ELSE ? END)"
                " WHERE complete = 0 AND harness_exited_at IS NOT NULL AND harness_exited_at <= ?",
                (now, Cause.OK.value, Cause.INFRA_ERROR.value, Cause.HARNESS_ERROR.value, grace_due),
            ).rowcount
            if self.rollout_timeout_s is not None:
                changed += db.execute(
                    "UPDATE rollouts SET complete = 1, completed_at = ?, end_cause = ?"
                    " WHERE complete = 0 AND first_seen_at <= ?",
                    (now, Cause.TIMEOUT.value, now - self.rollout_timeout_s),
                ).rowcount
        return changed

    # --- reading ------------------------------------------------------------------------------
    def _infos(
        self, where: str, params: Sequence[object], limit: int | None = None, *, newest: bool = False
    ) -> list[RolloutInfo]:
        order = "completed_at, first_seen_at, rollout_id"
        sql = f"SELECT {_INFO_COLUMNS} FROM rollouts r WHERE {where} ORDER BY {order}"
        if newest and limit is not None:  # the last `limit` rows of that order, still oldest first
            backwards = "completed_at DESC, first_seen_at DESC, rollout_id DESC"
            # rowids first: the counting subqueries then run for `limit` rows, not for every row sorted
            newest_rows = f"SELECT rowid FROM rollouts WHERE {where} ORDER BY {backwards} LIMIT {int(limit)}"
            sql = f"SELECT {_INFO_COLUMNS} FROM rollouts r WHERE r.rowid IN ({newest_rows}) ORDER BY {order}"
        elif limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self._lock:
            rows = self._db.execute(sql, params).fetchall()
        return [
            RolloutInfo(
                rollout_id=row[0],
                attempt=row[1],
                task_id=row[2],
                mode=row[3],
                status=row[4],
                complete=bool(row[5]),
                end_cause=row[6],
                first_seen_at=row[7],
                last_span_at=row[8],
                completed_at=row[9],
                trained_step=row[10],
                dropped_reason=row[11],
                calls=row[12],
                rewards=row[13],
                error=row[14],
                harness_exit_code=row[15],
                late_spans=row[16],
            )
            for row in rows
        ]

    def ready_rollouts(self, mode: str = semconv.MODE_TRAIN, limit: int | None = None) -> list[RolloutInfo]:
        """Complete rollouts of `mode` not yet trained on or dropped, oldest completion first."""
        if mode not in semconv.MODES:
            raise StoreError(f"mode must be one of {semconv.MODES}, got {mode!r}")
        self.refresh_completion()
        return self._infos(
            "complete = 1 AND trained_step IS NULL AND dropped_reason IS NULL AND COALESCE(mode, ?) = ?",
            (semconv.MODE_TRAIN, mode),
            limit,
        )

    def rollouts(self, limit: int | None = None, *, newest: bool = False) -> list[RolloutInfo]:
        """Every rollout, oldest first (for listing); with `newest`, the newest `limit` of them."""
        self.refresh_completion()
        return self._infos("1", (), limit, newest=newest)

    # An incremental reader (store/cursor.py): rollout rows are only added, and a row only moves
    # from in flight to complete to trained or dropped, so a reader that keeps the last row it read
    # and the rollouts then in flight need not read the others again.
    def last_row(self) -> int:
        """The newest rollout row's id (0: none): rows after it are the ones added since."""
        with self._lock:
            return int(self._db.execute("SELECT COALESCE(MAX(rowid), 0) FROM rollouts").fetchone()[0])

    def incomplete_rollouts(self) -> list[RolloutInfo]:
        """The rollouts not complete yet, after completing those due (read through the completion index)."""
        self.refresh_completion()
        return self._infos("complete = 0", ())

    def ready_among(
        self, keys: Iterable[RolloutKey], *, after_row: int, upto_row: int, mode: str = semconv.MODE_TRAIN
    ) -> list[RolloutInfo]:
        """The ready rollouts (as ready_rollouts, without completing any) among the rows
        after_row < rowid <= upto_row and `keys`: each read by the rowid or the primary key."""
        # The unary + keeps SQLite off the completion index, which would walk every ready row.
        ready = "+complete = 1 AND +trained_step IS NULL AND +dropped_reason IS NULL AND COALESCE(mode, ?) = ?"
        found = self._infos(f"r.rowid > ? AND r.rowid <= ? AND {ready}", (after_row, upto_row, semconv.MODE_TRAIN, mode))
        listed = [_key(k) for k in keys]
        for start in range(0, len(listed), 300):  # SQLite's limit on bound parameters
            chunk = listed[start : start + 300]
            ids, pairs = ", ".join("?" for _ in chunk), ", ".join("(?, ?)" for _ in chunk)
            params = [k.rollout_id for k in chunk] + [p for k in chunk for p in (k.rollout_id, k.attempt)]
            # rollout_id IN (...) lets the primary key find the rows; the row values pick the attempts.
            where = f"rollout_id IN ({ids}) AND (rollout_id, attempt) IN (VALUES {pairs}) AND {ready}"
            found += self._infos(where, (*params, semconv.MODE_TRAIN, mode))
        return found

    def rollout(self, key: RolloutKey | str) -> RolloutInfo | None:
        key = _key(key)
        found = self._infos("rollout_id = ? AND attempt = ?", (key.rollout_id, key.attempt))
        return found[0] if found else None

    def find(self, rollout_id_prefix: str) -> list[RolloutInfo]:
        return self._infos("rollout_id LIKE ? ESCAPE '\\'", (queries.like_prefix(rollout_id_prefix),))

    def load(self, key: RolloutKey | str) -> RolloutData:
        """A rollout's row, calls and rewards; raises StoreError when it is unknown."""
        key = _key(key)
        with self._lock:
            loaded = queries.load(self._db, key, "main")
        if loaded is None:
            raise StoreError(f"no rollout {key.rollout_id!r} attempt {key.attempt} in {self.path}")
        return loaded[0]

    def load_with_rows(self, key: RolloutKey | str) -> tuple[RolloutData, queries.CallRows] | None:
        """`load`, with each call's whole row (its start time, status, any column a newer store
        adds) as `queries.CallRows`; None when the rollout is unknown."""
        with self._lock:
            return queries.load(self._db, _key(key), "main")

    def rewards(self, key: RolloutKey | str) -> list[RewardRow]:
        """A rollout's reward rows (its attempt's and those naming no attempt), by (end, span id)."""
        with self._lock:
            return queries.rewards(self._db, _key(key), "main")

    def completed(self, keys: Iterable[RolloutKey | str]) -> set[RolloutKey]:
        """Which of `keys` are complete, or due to complete now, and neither trained on nor dropped.

        Read-only (no write lock, so a poll never waits behind the receiver's commits): a rollout
        that is due counts as complete here; `refresh_completion` records its completion and end
        cause, as `ready_rollouts` does before anything reads them."""
        now = self.clock()
        grace_due = now - self.grace_s
        timeout_due = None if self.rollout_timeout_s is None else now - self.rollout_timeout_s
        out: set[RolloutKey] = set()
        with self._lock:
            for key in {_key(item) for item in keys}:
                row = self._db.execute(
                    "SELECT 1 FROM rollouts WHERE rollout_id = ? AND attempt = ? AND trained_step IS NULL"
                    " AND dropped_reason IS NULL AND (complete = 1 OR rollout_span_at <= ? OR harness_exited_at <= ?"
                    " OR first_seen_at <= ?)",
                    (key.rollout_id, key.attempt, grace_due, grace_due, timeout_due),
                ).fetchone()
                if row is not None:
                    out.add(key)
        return out

    def final_rewards(
        self, keys: Iterable[RolloutKey | str], name: str = semconv.DEFAULT_REWARD_NAME
    ) -> dict[RolloutKey, float]:
        """The final reward (records.final_reward) of each of `keys` that has one."""
        out: dict[RolloutKey, float] = {}
        for key in {_key(item) for item in keys}:
            value = final_reward(self.rewards(key), name)
            if value is not None:
                out[key] = value
        return out

    # --- training state -----------------------------------------------------------------------
    def mark_trained(self, rollouts: Iterable[RolloutKey | str], step: int) -> int:
        """Record that `rollouts` were trained on at `step` (a bare id means attempt 0)."""
        keys = [_key(item) for item in rollouts]
        with self._transaction() as db:
            count = sum(
                db.execute(
                    "UPDATE rollouts SET trained_step = ? WHERE rollout_id = ? AND attempt = ?",
                    (step, key.rollout_id, key.attempt),
                ).rowcount
                for key in keys
            )
            db.execute(
                "INSERT INTO training_steps VALUES (?, ?, ?) ON CONFLICT (step) DO UPDATE SET"
                " rollouts = training_steps.rollouts + excluded.rollouts",
                (step, count, self.clock()),
            )
        return count

    def mark_dropped(self, rollouts: Iterable, reason: str | None = None) -> None:
        """Record rollouts that will never be trained on: `[(key, reason), ...]`, or keys and one `reason`."""
        pairs = [(item, reason) for item in rollouts] if reason is not None else list(rollouts)
        with self._transaction() as db:
            for key, why in pairs:
                key = _key(key)
                if not why:
                    raise StoreError(f"mark_dropped: no reason given for {key}")
                db.execute(
                    "UPDATE rollouts SET dropped_reason = ? WHERE rollout_id = ? AND attempt = ?",
                    (why, key.rollout_id, key.attempt),
                )

    def record_checkpoint(self, step: int, path: str) -> None:
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?)", (step, str(path), self.clock()))

    def last_checkpoint(self) -> tuple[int, str] | None:
        """(step, path) of the newest checkpoint, for a restarted trainer to resume from."""
        with self._lock:
            row = self._db.execute("SELECT step, path FROM checkpoints ORDER BY step DESC LIMIT 1").fetchone()
        return (row[0], row[1]) if row else None

    def last_step(self) -> int | None:
        with self._lock:
            row = self._db.execute("SELECT MAX(step) FROM training_steps").fetchone()
        return row[0]

    # --- statistics ---------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        self.refresh_completion()
        with self._lock:
            db = self._db
            total, complete, trained, dropped, ready = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(complete), 0), COUNT(trained_step), COUNT(dropped_reason),"
                " COALESCE(SUM(complete = 1 AND trained_step IS NULL AND dropped_reason IS NULL), 0)"
                " FROM rollouts"
            ).fetchone()
            by_cause = dict(
                db.execute("SELECT end_cause, COUNT(*) FROM rollouts WHERE complete = 1 GROUP BY end_cause")
            )
            violations = dict(db.execute("SELECT reason, COUNT(*) FROM violations GROUP BY reason"))
            calls = db.execute("SELECT COUNT(*) FROM calls").fetchone()[0]
            rewards = db.execute("SELECT COUNT(*) FROM rewards").fetchone()[0]
        return StoreStats(
            rollouts=total,
            complete=complete,
            ready=ready,
            trained=trained,
            dropped=dropped,
            by_cause=by_cause,
            calls=calls,
            rewards=rewards,
            violations=violations,
            last_step=self.last_step(),
        )

    def span_ids(self) -> set[tuple[bytes, bytes]]:
        """Every stored (trace id, span id)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT trace_id, span_id FROM calls UNION ALL SELECT trace_id, span_id FROM rewards"
                " UNION ALL SELECT trace_id, span_id FROM rollout_spans"
                " UNION ALL SELECT trace_id, span_id FROM violations"
            ).fetchall()
        return {(row[0], row[1]) for row in rows}


# What SQLite (or the sqlite3 module) refuses in a value: an int over int64, a string that is not
# UTF-8, a value of the wrong type. Not its own faults (OperationalError: full, I/O, locked).
_DATA_ERRORS = (
    OverflowError,
    UnicodeEncodeError,
    sqlite3.IntegrityError,
    sqlite3.InterfaceError,
    sqlite3.DataError,
)


def _rejected(record: Record) -> Violation:
    rollout_id = getattr(record, "rollout_id", None)
    if isinstance(rollout_id, str):
        try:
            rollout_id.encode()
        except UnicodeEncodeError:
            rollout_id = None
    return Violation(record.trace_id, record.span_id, "", "store_rejected", rollout_id)


def _size(array: np.ndarray | None) -> int:
    return 0 if array is None else int(array.size)


def _key(item: RolloutKey | str | tuple[str, int]) -> RolloutKey:
    if isinstance(item, RolloutKey):
        return item
    if isinstance(item, str):
        return RolloutKey(item, 0)
    if isinstance(item, tuple) and len(item) == 2:
        return RolloutKey(str(item[0]), int(item[1]))
    if isinstance(item, RolloutInfo):
        return item.key
    raise StoreError(f"expected a rollout id, (id, attempt) or RolloutKey, got {item!r}")
