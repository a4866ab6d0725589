"""The store's read side: every query over its tables (store/schema.py) outside the writer.

`RolloutStore.load` reads a rollout through `load` here; the viewer and the from-store cursor read
the store file read-only (a `mode=ro` URI), never writing to it. The viewer's connection is an
in-memory database with the store ATTACHed as `s` (`attach`), holding the viewer's own summary table
(per-rollout policy versions and merge breaks, filled by viewer/indexer.py), so one connection
can filter and sort on both. SQLite's WAL lets these reads run while training writes.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgspec

from agl_trainer.store.records import CallRow, RewardRow, RolloutData, RolloutInfo, RolloutKey
from agl_trainer.store.schema import SCHEMA_VERSION

SUMMARY = """
CREATE TABLE IF NOT EXISTS summary (
    rollout_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    calls INTEGER NOT NULL,
    reward REAL,                -- the final reward (records.final_reward) by the viewer's reward name
    min_version INTEGER,
    max_version INTEGER,
    merge_breaks INTEGER NOT NULL,
    break_kinds TEXT NOT NULL,
    samples INTEGER NOT NULL,
    assembled_reward REAL,
    dropped TEXT,
    last_span_at REAL NOT NULL,
    PRIMARY KEY (rollout_id, attempt)
);
CREATE INDEX IF NOT EXISTS summary_breaks ON summary (merge_breaks);
"""


class QueryError(Exception):
    """A query refused: a missing or foreign store, a bad filter (the viewer answers `status` with it)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _ro_uri(path: Path) -> str:
    return f"file:{quote(str(Path(path).resolve()))}?mode=ro"


def open_ro(path: Path) -> sqlite3.Connection:
    """A read-only connection to the store file at `path`, unchecked (see connect_ro)."""
    return sqlite3.connect(_ro_uri(path), uri=True, check_same_thread=False, timeout=30)


def connect_ro(path: Path) -> sqlite3.Connection:
    """A read-only connection to the store at `path` (never creates or changes the file)."""
    if not path.is_file():
        raise QueryError(f"no store at {path}", 404)
    db = open_ro(path)
    try:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as error:
        db.close()
        raise QueryError(f"{path} is not an agl rollout store: {error}") from None
    if version > SCHEMA_VERSION or not {"rollouts", "calls", "rewards"} <= tables:
        db.close()
        raise QueryError(f"{path} is not an agl rollout store this agl reads (schema {version})")
    return db


# --- the rollouts table -------------------------------------------------------------------------

# Per-rollout values the indexer keeps in the summary table (`m`); a rollout it has not reached yet
# is answered from the store directly (a correlated subquery: slow over 100k rows, exact always).
CALLS = (
    "CASE WHEN m.rollout_id IS NULL THEN (SELECT COUNT(*) FROM s.calls c"
    " WHERE c.rollout_id = r.rollout_id AND c.attempt = r.attempt) ELSE m.calls END"
)
# The SQL spelling of records.final_reward (the last whole-rollout reward by end, span id), for the
# rollouts not summarised yet; tests/dataplane/test_store_queries.py holds the two to the same answer.
REWARD = (
    "CASE WHEN m.rollout_id IS NULL THEN (SELECT w.value FROM s.rewards w WHERE w.rollout_id = r.rollout_id"
    " AND (w.attempt IS NULL OR w.attempt = r.attempt) AND w.name = :reward_name AND w.call_seq IS NULL"
    " ORDER BY w.end_ns DESC, w.span_id DESC LIMIT 1) ELSE m.reward END"
)
# A validation round's rollouts are `val` wherever a rollout's mode is shown or filtered: the greedy
# ones carry mode val, the ones sampled at the training temperature (mean@k) mode train, and both
# are dropped from training for this reason (loop/validation.py VAL_DROP_REASON).
VALIDATION_DROP = "validation"
MODE = f"CASE WHEN r.dropped_reason = '{VALIDATION_DROP}' THEN 'val' ELSE COALESCE(r.mode, 'train') END"


def shown_mode(mode: str | None, dropped_reason: str | None) -> str:
    """`MODE` for one rollout read in Python (the rollout page, `agl traces ls`)."""
    return "val" if dropped_reason == VALIDATION_DROP else mode or "train"


JOIN = "s.rollouts r LEFT JOIN main.summary m ON m.rollout_id = r.rollout_id AND m.attempt = r.attempt"

# API sort key -> SQL expression. Every expression is NULL-free (COALESCE) so that, with the rowid
# breaking ties, the order is total and pages never overlap.
SORTS: dict[str, str] = {
    "newest": "r.rowid",
    "rollout": "r.rollout_id",
    "task": "COALESCE(r.task_id, '')",
    "mode": MODE,
    "step": "COALESCE(r.trained_step, -1)",
    "version": "COALESCE(m.max_version, -1)",
    "reward": f"COALESCE({REWARD}, -1e308)",
    "cause": "COALESCE(r.end_cause, '')",
    "calls": CALLS,
    "breaks": "COALESCE(m.merge_breaks, -1)",
    "duration": "COALESCE(r.ended_ns - r.started_ns, -1)",
}
MAX_LIMIT = 500


def _listing() -> str:
    return (
        f"SELECT r.rowid AS rowid, r.rollout_id, r.attempt, r.task_id, {MODE} AS mode,"
        " r.status, r.complete, r.end_cause, r.trained_step, r.dropped_reason, r.first_seen_at,"
        " r.last_span_at, r.completed_at, r.started_ns, r.ended_ns, r.harness_exit_code, r.error,"
        f" {CALLS} AS calls, {REWARD} AS reward,"
        f" m.min_version, m.max_version, m.merge_breaks, m.break_kinds FROM {JOIN}"
    )


class Filters:
    """The rollouts table's filters, each checked and turned into SQL with named parameters."""

    def __init__(self, params: dict[str, str]) -> None:
        self.where: list[str] = []
        self.values: dict[str, Any] = {}
        text = {"task": "r.task_id = :task", "cause": "r.end_cause IS :cause", "id": "r.rollout_id LIKE :id ESCAPE '\\'"}
        for name, clause in text.items():
            value = params.get(name)
            if value:
                self.where.append(clause)
                self.values[name] = like_prefix(value) if name == "id" else value
        mode = params.get("mode")
        if mode:
            if mode not in ("train", "val"):
                raise QueryError(f"mode must be train or val, got {mode!r}")
            self.where.append(f"{MODE} = :mode")
            self.values["mode"] = mode
        step = params.get("step")
        if step:
            if step == "none":
                self.where.append("r.trained_step IS NULL")
            else:
                self.where.append("r.trained_step = :step")
                self.values["step"] = _int("step", step)
        state = params.get("state")
        if state:
            states = {
                "open": "r.complete = 0",
                "complete": "r.complete = 1",
                "trained": "r.trained_step IS NOT NULL",
                "dropped": "r.dropped_reason IS NOT NULL",
                "ready": "r.complete = 1 AND r.trained_step IS NULL AND r.dropped_reason IS NULL",
            }
            if state not in states:
                raise QueryError(f"state must be one of {sorted(states)}, got {state!r}")
            self.where.append(states[state])
        ranges = {
            "reward": (f"({REWARD})", float),
            "calls": (f"({CALLS})", int),
            "version": ("m.max_version", int),
            "breaks": ("m.merge_breaks", int),
        }
        for name, (column, kind) in ranges.items():
            for bound, op in (("min", ">="), ("max", "<=")):
                key = f"{bound}_{name}"
                raw = params.get(key)
                if raw:
                    self.where.append(f"{column} {op} :{key}")
                    self.values[key] = _float(key, raw) if kind is float else _int(key, raw)

    def _where(self) -> str:
        return " WHERE " + " AND ".join(self.where) if self.where else ""

    def _from(self, order: str = "") -> str:
        """The summary joined only when a filter or the order reads it (a join is a lookup per row)."""
        where = self._where()
        return (JOIN if "m." in where or "m." in order else "s.rollouts r") + where

    def page_sql(self, *, order: str, limit: int, offset: int) -> str:
        """The page's rowids only: OFFSET then skips rows without building them (no subqueries)."""
        return f"SELECT r.rowid FROM {self._from(order)} ORDER BY {order} LIMIT {limit} OFFSET {offset}"

    def count_sql(self) -> str:
        return f"SELECT COUNT(*) FROM {self._from()}"


def page(
    db: sqlite3.Connection, filters: Filters, reward_name: str, order: str, limit: int, offset: int
) -> tuple[list[dict[str, Any]], int]:
    """One page of the rollouts table (its rows, in order) and how many rows the filters let through."""
    values = {**filters.values, "reward_name": reward_name}  # SQLite ignores unused names
    rowids = [row[0] for row in db.execute(filters.page_sql(order=order, limit=limit, offset=offset), values)]
    total = db.execute(filters.count_sql(), values).fetchone()[0]
    return page_rows(db, rowids, reward_name), total


def page_rows(db: sqlite3.Connection, rowids: list[int], reward_name: str) -> list[dict[str, Any]]:
    """The listing's rows for `rowids`, in that order."""
    if not rowids:
        return []
    sql = _listing() + " WHERE r.rowid IN (SELECT value FROM json_each(:rowids))"
    cursor = db.execute(sql, {"reward_name": reward_name, "rowids": json.dumps(rowids)})
    names = [d[0] for d in cursor.description]
    rows = {row[0]: dict(zip(names, row, strict=True)) for row in cursor.fetchall()}
    return [rows[rowid] for rowid in rowids if rowid in rows]


def _int(name: str, raw: str, low: int = -(2**63), high: int = 2**63 - 1) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise QueryError(f"{name} must be an integer, got {raw[:40]!r}") from None
    if not low <= value <= high:
        raise QueryError(f"{name} must be between {low} and {high}, got {value}")
    return value


def _float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise QueryError(f"{name} must be a number, got {raw[:40]!r}") from None
    if not math.isfinite(value):
        raise QueryError(f"{name} must be a finite number, got {raw[:40]!r}")
    return value


def like_prefix(prefix: str) -> str:
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def parse_page(params: dict[str, str]) -> tuple[str, int, int]:
    """(ORDER BY clause, limit, offset) from `sort`, `order` (asc|desc), `limit`, `offset`."""
    sort = params.get("sort") or "newest"
    if sort not in SORTS:
        raise QueryError(f"sort must be one of {sorted(SORTS)}, got {sort[:40]!r}")
    direction = (params.get("order") or "desc").lower()
    if direction not in ("asc", "desc"):
        raise QueryError(f"order must be asc or desc, got {direction[:40]!r}")
    limit = _int("limit", params.get("limit") or "50", 1, MAX_LIMIT)
    offset = _int("offset", params.get("offset") or "0", 0, 10**9)
    expression = SORTS[sort]
    order = f"{expression} {direction}" if sort == "newest" else f"{expression} {direction}, r.rowid {direction}"
    return order, limit, offset


# --- one rollout --------------------------------------------------------------------------------

_KNOWN_CALL_COLUMNS = {
    "trace_id", "span_id", "rollout_id", "attempt", "call_seq", "name", "start_ns", "end_ns", "prompt_ids",
    "completion_ids", "logprobs", "prompt_ref_seq", "prompt_ref_length", "prompt_length", "policy_version",
    "finish_reason", "end_reason", "tokens_source", "choices", "status_code", "received_at",
    "held_ms", "upstream", "api",  # schema 4: the call's own fields in the API (detail.py)
    "fields_dropped", "fields_passed",  # schema 6: lists, the call's own fields in the API too
}  # fmt: skip


# Blob columns -> their numpy dtypes (little-endian int32 tokens, float32 logprobs, int64 version runs).
_ARRAYS = {"prompt_ids": "<i4", "completion_ids": "<i4", "logprobs": "<f4", "policy_versions": "<i8"}
_CALL_FIELDS = CallRow.__struct_fields__  # what this agl's CallRow holds (a newer store may hold more)
# Text columns holding a JSON array of strings (rollout_store._text_list): read as tuples, NULL as ().
_TEXT_LISTS = frozenset({"fields_dropped", "fields_passed"})
_decode_text_list = msgspec.json.Decoder(tuple[str, ...]).decode


def _value(name: str, value: Any) -> Any:
    if name in _TEXT_LISTS:
        return _text_list(value)
    dtype = _ARRAYS.get(name)
    if dtype is None or value is None:
        return value
    import numpy as np  # here, not at the top: listing rollouts (`agl traces ls`) needs no numpy

    return np.frombuffer(value, dtype=dtype)


def _text_list(value: Any) -> tuple[str, ...]:
    if not isinstance(value, str):
        return ()
    try:
        return _decode_text_list(value)
    except msgspec.MsgspecError:  # not written by this store (a hand edit): shown as nothing, not a 500
        return ()


def rollout_row(db: sqlite3.Connection, key: RolloutKey, schema: str = "s") -> dict[str, Any] | None:
    """The rollout's row as a dict; `schema` names the store's database on `db` ("main": its own)."""
    cursor = db.execute(
        f"SELECT * FROM {schema}.rollouts WHERE rollout_id = ? AND attempt = ?", (key.rollout_id, key.attempt)
    )
    row = cursor.fetchone()
    if row is None:
        return None
    return dict(zip([d[0] for d in cursor.description], row, strict=True))


def attempts(db: sqlite3.Connection, rollout_id: str) -> list[int]:
    rows = db.execute("SELECT attempt FROM s.rollouts WHERE rollout_id = ? ORDER BY attempt", (rollout_id,))
    return [row[0] for row in rows]


class CallRows:
    """Each call's row as a dict (timing, status, and any column a newer store adds, e.g. the
    sidecar's attribution), made only for the rows asked for: a page of a 20,000-call rollout."""

    def __init__(self, names: list[str], rows: list[tuple]) -> None:
        self.names = names
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, window: slice) -> list[dict[str, Any]]:
        return [self._row(dict(zip(self.names, values, strict=True))) for values in self.rows[window]]

    @staticmethod
    def _row(c: dict[str, Any]) -> dict[str, Any]:
        extra = {k: v for k, v in c.items() if k not in _KNOWN_CALL_COLUMNS and not isinstance(v, bytes)}
        return {
            "call_seq": c["call_seq"],
            "start_ns": c["start_ns"],
            "end_ns": c["end_ns"],
            "status_code": c["status_code"],
            "received_at": c["received_at"],
            "span_id": c["span_id"].hex() if isinstance(c["span_id"], bytes) else None,
            "trace_id": c["trace_id"].hex() if isinstance(c["trace_id"], bytes) else None,
            "extra": extra,
        }

    def column(self, name: str) -> list[Any]:
        if name not in self.names:
            return []
        i = self.names.index(name)
        return [values[i] for values in self.rows]


def rewards(db: sqlite3.Connection, key: RolloutKey, schema: str = "s") -> list[RewardRow]:
    """A rollout's rewards (its attempt's and those naming no attempt), by (end, span id)."""
    rows = db.execute(
        f"SELECT span_id, name, value, call_seq, end_ns FROM {schema}.rewards WHERE rollout_id = ?"
        " AND (attempt IS NULL OR attempt = ?) ORDER BY end_ns, span_id",
        (key.rollout_id, key.attempt),
    ).fetchall()
    return [RewardRow(*row) for row in rows]


def load(db: sqlite3.Connection, key: RolloutKey, schema: str = "s") -> tuple[RolloutData, CallRows] | None:
    """The rollout's row, calls (by call_seq, end, span id) and rewards, plus its calls' rows
    (CallRows); None when it is unknown. `RolloutStore.load` is this on its own connection."""
    row = rollout_row(db, key, schema)
    if row is None:
        return None
    cursor = db.execute(
        f"SELECT * FROM {schema}.calls WHERE rollout_id = ? AND attempt = ? ORDER BY call_seq, end_ns, span_id",
        (key.rollout_id, key.attempt),
    )
    names = [d[0] for d in cursor.description]
    raw_calls = cursor.fetchall()
    fields = [(name, names.index(name)) for name in _CALL_FIELDS if name in names]
    calls = [CallRow(**{name: _value(name, values[i]) for name, i in fields}) for values in raw_calls]
    found = rewards(db, key, schema)
    info = RolloutInfo(
        rollout_id=row["rollout_id"],
        attempt=row["attempt"],
        task_id=row["task_id"],
        mode=row["mode"],
        status=row["status"],
        complete=bool(row["complete"]),
        end_cause=row["end_cause"],
        first_seen_at=row["first_seen_at"],
        last_span_at=row["last_span_at"],
        completed_at=row["completed_at"],
        trained_step=row["trained_step"],
        dropped_reason=row["dropped_reason"],
        calls=len(calls),
        rewards=len(found),
        error=row["error"],
        harness_exit_code=row["harness_exit_code"],
        late_spans=row["late_spans"],
    )
    return RolloutData(info=info, calls=calls, rewards=found), CallRows(names, raw_calls)


def step_rollouts(db: sqlite3.Connection, step: int, reward_name: str) -> list[dict[str, Any]]:
    sql = (
        f"SELECT * FROM ({_listing()} WHERE r.complete = 1 AND r.trained_step = :step)"
        " ORDER BY COALESCE(task_id, rollout_id), rollout_id, attempt"
    )
    cursor = db.execute(sql, {"step": step, "reward_name": reward_name})
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def steps(db: sqlite3.Connection) -> list[dict[str, Any]]:
    rows = db.execute("SELECT step, rollouts, at FROM s.training_steps ORDER BY step").fetchall()
    return [{"step": s, "rollouts": n, "at": at} for s, n, at in rows]


def step_rewards(db: sqlite3.Connection, reward_name: str) -> list[dict[str, Any]]:
    """Mean final reward of the rollouts trained at each step (the curve when metrics.jsonl is absent)."""
    sql = (
        f"SELECT trained_step, AVG(reward), COUNT(reward) FROM ({_listing()}"
        " WHERE r.complete = 1 AND r.trained_step IS NOT NULL) GROUP BY trained_step ORDER BY trained_step"
    )
    rows = db.execute(sql, {"reward_name": reward_name}).fetchall()
    return [{"step": s, "reward/mean": mean, "rollouts": n} for s, mean, n in rows if mean is not None]


def step_row(db: sqlite3.Connection, step: int) -> tuple[int, float] | None:
    """(rollouts, at) of training step `step`, or None."""
    return db.execute("SELECT rollouts, at FROM s.training_steps WHERE step = ?", (step,)).fetchone()


def rollout_count(db: sqlite3.Connection) -> int:
    return int(db.execute("SELECT COUNT(*) FROM s.rollouts").fetchone()[0])


def touched_since(db: sqlite3.Connection, last_span_at: float) -> list[tuple[str, int, float]]:
    """(rollout id, attempt, last span at) of the rollouts with a span after `last_span_at`, newest row first."""
    return db.execute(
        "SELECT rollout_id, attempt, last_span_at FROM s.rollouts WHERE last_span_at > ? ORDER BY rowid DESC",
        (last_span_at,),
    ).fetchall()


def call_versions(store_path: Path, newest: bool = False) -> dict[RolloutKey, int]:
    """The oldest (or newest) policy version among each rollout's calls (read-only: the receiver may be writing)."""
    db = open_ro(store_path)
    try:
        rows = db.execute(
            f"SELECT rollout_id, attempt, {'MAX' if newest else 'MIN'}(policy_version) FROM calls"
            " WHERE policy_version IS NOT NULL GROUP BY rollout_id, attempt"
        ).fetchall()
    finally:
        db.close()
    return {RolloutKey(r, a): int(v) for r, a, v in rows}


def call_versions_since(store_path: Path, after_row: int) -> list[tuple[int, str, int, int]]:
    """(call row, rollout id, attempt, policy version) of the calls with a version after row `after_row`."""
    db = open_ro(store_path)
    try:
        return db.execute(
            "SELECT rowid, rollout_id, attempt, policy_version FROM calls"
            " WHERE rowid > ? AND policy_version IS NOT NULL ORDER BY rowid",
            (after_row,),
        ).fetchall()
    finally:
        db.close()


def overview(db: sqlite3.Connection) -> dict[str, Any]:
    total, complete, trained, dropped = db.execute(
        "SELECT COUNT(*), COALESCE(SUM(complete), 0), COUNT(trained_step), COUNT(dropped_reason) FROM s.rollouts"
    ).fetchone()
    causes = dict(db.execute("SELECT COALESCE(end_cause, ''), COUNT(*) FROM s.rollouts WHERE complete = 1 GROUP BY 1"))
    violations = dict(db.execute("SELECT reason, COUNT(*) FROM s.violations GROUP BY reason"))
    last_step = db.execute("SELECT MAX(step) FROM s.training_steps").fetchone()[0]
    return {
        "rollouts": total,
        "complete": complete,
        "trained": trained,
        "dropped": dropped,
        "by_cause": causes,
        "violations": violations,
        "last_step": last_step,
    }


def attach(store_path: Path) -> sqlite3.Connection:
    """An in-memory database with the store attached read-only as `s`."""
    # Autocommit: a transaction left open (by an INSERT into the summary) would pin the store's
    # snapshot, and the pages would stop seeing what training writes.
    db = sqlite3.connect(":memory:", uri=True, check_same_thread=False, timeout=30, isolation_level=None)
    db.execute("ATTACH DATABASE ? AS s", (_ro_uri(store_path),))
    return db


class Database:
    """One connection (in-memory main + the store attached read-only as `s`), shared under a lock."""

    def __init__(self, store_path: Path) -> None:
        connect_ro(store_path).close()  # a clear error for a missing or foreign file
        self.store_path = store_path
        self.db = attach(store_path)
        self.db.executescript(SUMMARY)
        self.lock = threading.Lock()

    def query(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[tuple]:
        with self.lock:
            return self.db.execute(sql, params).fetchall()

    def close(self) -> None:
        with self.lock:
            self.db.close()
