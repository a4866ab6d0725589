"""Declared structure through the receiver, the store and assembly: the agent ids and compaction a
harness declared are stored with the call; a declared compaction starts a new sample of the same
rollout (not a merge failure); assembly reports each call whose prefix-built parent disagrees with
the declared agents, counted in the report and named per call in `agl traces inspect`."""

from __future__ import annotations

import sqlite3

from agl_trainer.assembly.assemble import (
    DECLARED_OTHER_AGENT,
    DECLARED_THREAD_BROKEN,
    START_COMPACTION,
    START_CONTEXT_EDIT,
    START_DECLARED,
)
from agl_trainer.store import RolloutStore
from agl_trainer.store.records import CONTEXT_EDITED

from tests.dataplane.otlp import with_attributes
from tests.dataplane.test_tree_assembly import main_sub_compaction, run

MAIN = {"agl__call__agent_id": "main"}
SUB = {"agl__call__agent_id": "sub-1", "agl__call__parent_agent_id": "main"}


def declared(agents: dict[int, dict], compaction: tuple[int, ...] = ()):
    spans = main_sub_compaction()  # calls 0, 1, 3 main; 2, 4 a sub-agent; 5 a compaction; 6 after it
    for seq, span in enumerate(spans):
        with_attributes(span, **agents.get(seq, {}))
        if seq in compaction:
            with_attributes(span, agl__call__compaction=True)
    return spans


AGREEING = {0: MAIN, 1: MAIN, 2: SUB, 3: MAIN, 4: SUB, 5: MAIN, 6: MAIN}


def test_declared_agents_and_compaction_are_stored(store):
    run(store, declared(AGREEING, compaction=(5,)))
    calls = {c.call_seq: c for c in store.load("r").calls}
    assert [calls[s].agent_id for s in range(7)] == ["main", "main", "sub-1", "main", "sub-1", "main", "main"]
    assert [calls[s].parent_agent_id for s in range(7)] == [None, None, "main", None, "main", None, None]
    assert [bool(calls[s].compaction) for s in range(7)] == [False] * 5 + [True, False]


def test_a_declared_compaction_starts_a_new_sample_that_is_no_merge_failure(store):
    result, detail = run(store, declared(AGREEING, compaction=(5,)))
    placements = {p.call_seq: p for p in detail.placements}
    assert placements[5].start == START_COMPACTION and placements[6].merged
    assert [f.call_seq for f in detail.merge_failures] == [2]  # only the sub-agent's first call
    assert result.report.compaction_calls == 1 and result.report.declared_tree_disagreements == 0
    assert len(result.rollouts) == 1 and len(result.rollouts[0].samples) == 3  # one rollout, one reward


def test_a_compaction_that_extends_its_thread_still_starts_a_new_sample(store):
    result, detail = run(store, declared(AGREEING, compaction=(5, 6)))
    placements = {p.call_seq: p for p in detail.placements}
    assert placements[6].parent == 5 and placements[6].start == START_COMPACTION and not placements[6].merged
    assert len(result.rollouts[0].samples) == 4


def test_disagreements_with_the_declared_tree_are_reported_per_call(store):
    # call 4 says it is the main agent's but extends the sub-agent's call 2; call 5 breaks the main
    # thread without declaring a compaction
    result, detail = run(store, declared({**AGREEING, 4: MAIN}))
    placements = {p.call_seq: p for p in detail.placements}
    assert {s: p.declared for s, p in placements.items() if p.declared} == {
        4: DECLARED_OTHER_AGENT,
        5: DECLARED_THREAD_BROKEN,
    }
    assert result.report.declared_tree_disagreements == 2 and result.report.compaction_calls == 0
    # the declared tree wins: call 4 extends the sub-agent's call 2 but starts a sample of its own,
    # no merge failure (it extends its prefix parent exactly)
    assert placements[4].parent == 2 and placements[4].start == START_DECLARED and not placements[4].merged
    assert 4 not in [f.call_seq for f in detail.merge_failures]
    # samples: main 0-1-3, sub 2, call 4 alone, 5-6 (5 breaks the thread): 4 (3 when 4 joined sub's 2)
    assert len(result.rollouts[0].samples) == 4


def test_calls_that_declare_nothing_report_nothing(store):
    result, detail = run(store, declared({}))
    assert result.report.declared_tree_disagreements == 0
    assert all(p.agent_id is None and p.declared is None for p in detail.placements)


def test_inspect_names_each_call_s_agent_and_the_disagreement(store, store_path, capsys, monkeypatch):
    from agl_trainer.cli import main

    monkeypatch.setenv("COLUMNS", "250")
    run(store, declared({**AGREEING, 4: MAIN}))
    assert main(["traces", "inspect", "r", "--store", str(store_path)]) == 0
    out = capsys.readouterr().out
    assert "agent" in out and "sub-1" in out
    assert DECLARED_OTHER_AGENT in out and DECLARED_THREAD_BROKEN in out


def test_a_schema_4_store_gains_the_declared_columns(store_path):
    with RolloutStore(store_path, grace_s=0.0) as store:
        run(store, declared({}))
    with sqlite3.connect(store_path) as db:
        for column in ("fields_dropped", "fields_passed", "agent_id", "parent_agent_id", "compaction"):  # schema 6, 5
            db.execute(f"ALTER TABLE calls DROP COLUMN {column}")
        db.execute("PRAGMA user_version=4")
    with RolloutStore(store_path, grace_s=0.0) as store:
        assert [c.agent_id for c in store.load("r").calls] == [None] * 7


def test_a_prompt_the_sidecar_edited_starts_a_sample_named_a_context_edit(store):
    """agl.call.context_edits (Anthropic's context editing, applied by the sidecar): an edited call
    that extends no earlier call starts a sample as a context edit, not a merge failure; one whose
    prompt still extends its thread merges as any call."""
    spans = declared(AGREEING)
    with_attributes(spans[5], agl__call__context_edits=["clear_tool_uses_20250919"])
    with_attributes(spans[3], agl__call__context_edits=["clear_thinking_20251015"])
    result, detail = run(store, spans)
    calls = {c.call_seq: c for c in store.load("r").calls}
    assert [calls[s].compaction for s in range(7)] == [None, None, None, CONTEXT_EDITED, None, CONTEXT_EDITED, None]
    placements = {p.call_seq: p for p in detail.placements}
    assert placements[5].start == START_CONTEXT_EDIT and placements[6].merged
    assert placements[3].merged  # edited, yet it extends call 1: nothing to explain
    assert [f.call_seq for f in detail.merge_failures] == [2]  # only the sub-agent's first call
    assert result.report.context_edit_calls == 1 and result.report.compaction_calls == 0
    assert result.report.declared_tree_disagreements == 0  # an edit explains a broken thread too
