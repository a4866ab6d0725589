"""The store's read side (store/queries.py): the viewer's read-only connection loads a rollout as
`RolloutStore.load` does, and the SQL spelling of the final reward picks what records.final_reward
picks (the last whole-rollout reward by end, then span id)."""

from __future__ import annotations

import msgspec
from agl import semconv
from agl_trainer.store import RolloutKey, queries
from agl_trainer.store.records import final_reward

from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import call_span, reward_span, rollout_span
from tests.dataplane.otlp import with_attributes

RUNS = semconv.COMPLETION_POLICY_VERSIONS.replace(".", "__")
T0 = 1_700_000_000_000_000_000


def _plain(data: object) -> object:
    """A RolloutData as builtins (numpy arrays as lists) to compare two loads."""
    return msgspec.to_builtins(data, enc_hook=lambda a: a.tolist())


def test_the_read_only_load_is_the_stores_load(store, store_path) -> None:
    spans = [
        with_attributes(call_span("r", 0, [1, 2], [10, 11, 12, 13], version=3), **{RUNS: [0, 3, 2, 4]}),
        call_span("r", 1, [1, 2, 10, 11, 12, 13, 7], [20, 21], version=4),
        reward_span("r", 0.25, call_seq=1),
        reward_span("r", 1.0),
        reward_span("r", 0.5, attempt=None),  # names no attempt: applies to attempt 0 too
        rollout_span("r"),
    ]
    assert ingest(store, spans).violations == {}
    db = queries.attach(store_path)
    try:
        loaded = queries.load(db, RolloutKey("r", 0))
        assert queries.load(db, RolloutKey("r", 1)) is None
    finally:
        db.close()
    assert loaded is not None
    data, rows = loaded
    assert _plain(data) == _plain(store.load("r"))
    assert data.calls[0].policy_versions.tolist() == [0, 3, 2, 4]  # decoded, not left as bytes
    assert len(rows) == 2 and rows[0:1][0]["call_seq"] == 0


def test_the_sql_final_reward_is_records_final_reward(store, store_path) -> None:
    # Whole-rollout rewards out of arrival order, a tie on end broken by span id, a per-call reward
    # that ends last, another name, and a reward that names no attempt.
    ties = sorted([bytes([9] * 8), bytes([3] * 8)])
    spans = [
        call_span("a", 0, [1], [2]),
        reward_span("a", 0.9, start_ns=T0 + 50, span_id=ties[1]),
        reward_span("a", 0.1, start_ns=T0 + 50, span_id=ties[0]),
        reward_span("a", 0.7, start_ns=T0 + 10),
        reward_span("a", 5.0, start_ns=T0 + 90, call_seq=0),
        reward_span("a", 8.0, start_ns=T0 + 95, name="other"),
        call_span("b", 0, [1], [2]),
        reward_span("b", 0.3, start_ns=T0 + 5),
        reward_span("b", 0.6, start_ns=T0 + 7, attempt=None),
        call_span("c", 0, [1], [2]),
        reward_span("c", 4.0, call_seq=0),
    ]
    assert ingest(store, spans).violations == {}
    database = queries.Database(store_path)  # nothing summarised yet: the listing reads the store's rewards
    try:
        rows = queries.page_rows(database.db, [1, 2, 3], semconv.DEFAULT_REWARD_NAME)
    finally:
        database.close()
    by_sql = {row["rollout_id"]: row["reward"] for row in rows}
    by_rule = {key: final_reward(store.load(key).rewards, semconv.DEFAULT_REWARD_NAME) for key in "abc"}
    assert by_sql == by_rule == {"a": 0.9, "b": 0.6, "c": None}
