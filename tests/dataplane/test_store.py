"""Completion (rollout span, harness exit + grace, timeout), training state across restarts."""

from __future__ import annotations

import sqlite3

import pytest
from agl import semconv
from agl_trainer.store import RolloutKey, RolloutStore, StoreError

from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import call_span, reward_span, rollout_span


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def open_store(path, clock, **kwargs) -> RolloutStore:
    return RolloutStore(path, clock=clock, **kwargs)


def ready_ids(store: RolloutStore, mode: str = "train") -> list[str]:
    return [r.rollout_id for r in store.ready_rollouts(mode)]


def test_rollout_span_completes_after_grace(store_path, clock):
    with open_store(store_path, clock, grace_s=2.0) as store:
        ingest(store, [call_span("a", 0, [1], [2]), rollout_span("a")])
        ingest(store, [call_span("b", 0, [1], [2]), rollout_span("b", status=semconv.STATUS_FAILED)])
        assert ready_ids(store) == []  # late spans may still come
        clock.now += 2.5
        ready = {r.rollout_id: r for r in store.ready_rollouts()}
        assert {k: v.end_cause for k, v in ready.items()} == {"a": "ok", "b": "harness_error"}
        ingest(store, [call_span("a", 1, [1, 2, 3], [4])])  # after completion: kept and counted
        assert store.rollout("a").late_spans == 1 and store.rollout("a").calls == 2


def test_harness_exit_completes_with_cause(store_path, clock):
    with open_store(store_path, clock, grace_s=1.0) as store:
        for rollout_id in ("ok", "crash", "infra", "silent"):
            ingest(store, [call_span(rollout_id, 0, [1], [2])])
        store.mark_harness_exited("ok", 0)
        store.mark_harness_exited("crash", 3)
        store.mark_harness_exited("infra", None, cause="infra_error")
        store.mark_harness_exited("never-seen", 0)  # a harness that made no call at all
        assert ready_ids(store) == []
        clock.now += 1.0
        causes = {r.rollout_id: r.end_cause for r in store.ready_rollouts()}
        assert causes == {"ok": "ok", "crash": "harness_error", "infra": "infra_error", "never-seen": "ok"}
        assert store.rollout("crash").harness_exit_code == 3
        with pytest.raises(StoreError, match="cause must be one of"):
            store.mark_harness_exited("x", 1, cause="bogus")


def test_the_runners_cause_wins_over_the_rollout_span(store_path, clock):
    with open_store(store_path, clock, grace_s=0.0) as store:
        ingest(
            store, [call_span("killed", 0, [1], [2]), rollout_span("killed", status=semconv.STATUS_FAILED)]
        )
        store.mark_harness_exited("killed", -9, cause="timeout")  # the runner killed it at its deadline
        assert store.rollout("killed").end_cause is None
        assert [r.end_cause for r in store.ready_rollouts()] == ["timeout"]


def test_timeout_and_modes(store_path, clock):
    with open_store(store_path, clock, grace_s=0.0, rollout_timeout_s=60) as store:
        ingest(store, [call_span("slow", 0, [1], [2])])
        ingest(store, [call_span("v", 0, [1], [2], mode="val"), rollout_span("v", mode="val")])
        assert ready_ids(store) == [] and ready_ids(store, "val") == ["v"]
        clock.now += 61
        assert ready_ids(store) == ["slow"]
        assert store.rollout("slow").end_cause == "timeout"
        with pytest.raises(StoreError, match="mode must be one of"):
            store.ready_rollouts("test")


def test_training_state_survives_a_restart(store_path, clock):
    with open_store(store_path, clock, grace_s=0.0) as store:
        for rollout_id in ("a", "b", "c"):
            ingest(
                store,
                [call_span(rollout_id, 0, [1], [2]), reward_span(rollout_id, 1.0), rollout_span(rollout_id)],
            )
        assert ready_ids(store) == ["a", "b", "c"]
        assert store.mark_trained(["a"], step=1) == 1
        store.mark_dropped([("b", "stale")])
        store.record_checkpoint(1, "/ckpt/1")
        assert store.completed(["a", "b", "c", "zz"]) == {RolloutKey("c", 0)}
        assert store.final_rewards(["a", "c", "zz"]) == {RolloutKey("a", 0): 1.0, RolloutKey("c", 0): 1.0}
        with pytest.raises(StoreError, match="no reason"):
            store.mark_dropped([("c", "")])
    with open_store(store_path, clock, grace_s=0.0) as store:  # a restarted trainer
        assert ready_ids(store) == ["c"]
        assert store.last_step() == 1 and store.last_checkpoint() == (1, "/ckpt/1")
        stats = store.stats()
        assert (stats.rollouts, stats.trained, stats.dropped, stats.ready, stats.calls) == (3, 1, 1, 1, 3)
        assert store.rollout("b").dropped_reason == "stale"


def test_completed_sees_due_rollouts_without_the_write_lock(store_path, clock):
    """The loop polls `completed`; it must answer while another connection (the receiver) holds the
    write lock, and count a rollout due by span, exit or timeout as complete before any refresh."""
    with open_store(store_path, clock, grace_s=1.0, rollout_timeout_s=60) as store:
        ingest(store, [call_span("span", 0, [1], [2]), rollout_span("span")])
        ingest(store, [call_span("exit", 0, [1], [2])])
        ingest(store, [call_span("slow", 0, [1], [2])])
        store.mark_harness_exited("exit", 3)
        keys = ["span", "exit", "slow", "unknown"]
        assert store.completed(keys) == set()  # within the grace period
        clock.now += 1.5
        writer = sqlite3.connect(store_path, isolation_level=None)
        writer.execute("BEGIN IMMEDIATE")  # the receiver mid-commit
        try:
            with open_store(store_path, clock, grace_s=1.0, rollout_timeout_s=60, busy_timeout_s=0.05) as poller:
                assert poller.completed(keys) == {RolloutKey("span", 0), RolloutKey("exit", 0)}
                clock.now += 60
                assert poller.completed(keys) == {RolloutKey("span", 0), RolloutKey("exit", 0), RolloutKey("slow", 0)}
        finally:
            writer.execute("ROLLBACK")
            writer.close()
        assert store.rollout("exit").end_cause is None  # recorded only by a refresh
        store.mark_dropped([("slow", "stale")])
        store.mark_trained(["span"], step=1)
        assert store.completed(keys) == {RolloutKey("exit", 0)}
        assert store.refresh_completion() == 3 and store.rollout("exit").end_cause == "harness_error"


def test_attempts_are_separate_and_unattributed_rewards_apply_to_each(store_path, clock):
    with open_store(store_path, clock, grace_s=0.0) as store:
        ingest(store, [call_span("r", 0, [1], [2], attempt=0), rollout_span("r", attempt=0)])
        ingest(store, [call_span("r", 0, [1], [5], attempt=1), rollout_span("r", attempt=1)])
        ingest(store, [reward_span("r", 0.5, attempt=None)])
        ready = store.ready_rollouts()
        assert [(r.rollout_id, r.attempt) for r in ready] == [("r", 0), ("r", 1)]
        assert store.load(("r", 1)).calls[0].completion_ids.tolist() == [5]
        assert [w.value for w in store.load(("r", 1)).rewards] == [0.5]
        assert [w.value for w in store.load(("r", 0)).rewards] == [0.5]


def test_bad_store_arguments(tmp_path):
    not_a_db = tmp_path / "x.db"
    not_a_db.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="not an agl rollout store"):
        RolloutStore(not_a_db)
    with pytest.raises(StoreError, match="durability"):
        RolloutStore(tmp_path / "y.db", durability="fast")
    with RolloutStore(tmp_path / "z.db") as store, pytest.raises(StoreError, match="no rollout"):
        store.load("missing")
