"""Calls merge onto the call tree: interleaved sub-agents, compaction, retries, undelivered calls,
calls from outside the harness's trace, a broken prefix in the middle. Samples and masks are
checked token by token."""

from __future__ import annotations

import pytest
from agl import semconv
from agl_trainer.assembly import AssemblyConfig, assemble
from agl_trainer.batch import TrainingBatch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import call_span, reward_span, rollout_span, with_attributes


def run(store, spans, config: AssemblyConfig | None = None):
    ingest(store, [*spans, reward_span("r", 1.0), rollout_span("r")])
    result = assemble(store, store.ready_rollouts(), config or AssemblyConfig())
    [detail] = result.details
    return result, detail


def trained(sample) -> list[int]:
    return [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]


# A main thread (calls 0, 1, 3), a sub-agent (calls 2, 4) sharing only the system prompt's first
# tokens, and a compaction (call 5: system prompt + a summary) that the main thread goes on from (6).
SYSTEM = [1, 2, 3]
P0, C0 = SYSTEM + [20], [30, 31]
P1, C1 = P0 + C0 + [21, 22], [32]
P2, C2 = [1, 2, 40, 41], [50, 51]
P3, C3 = P1 + C1 + [23], [33, 34]
P4, C4 = P2 + C2 + [42], [52]
P5, C5 = SYSTEM + [60, 61], [35]
P6, C6 = P5 + C5 + [24], [36]


def main_sub_compaction() -> list[Span]:
    calls = [(P0, C0), (P1, C1), (P2, C2), (P3, C3), (P4, C4), (P5, C5), (P6, C6)]
    return [call_span("r", seq, p, c) for seq, (p, c) in enumerate(calls)]


def test_interleaved_sub_agent_and_compaction_make_one_sample_per_thread(store):
    result, detail = run(store, main_sub_compaction())
    main, sub, compacted = result.rollouts[0].samples
    assert main.call_seqs == [0, 1, 3] and sub.call_seqs == [2, 4] and compacted.call_seqs == [5, 6]
    assert main.token_ids.tolist() == P3 + C3
    assert main.loss_mask.tolist() == [0] * 4 + [1, 1] + [0, 0] + [1] + [0] + [1, 1]
    assert trained(main) == C0 + C1 + C3
    assert sub.token_ids.tolist() == P4 + C4 and sub.loss_mask.tolist() == [0] * 4 + [1, 1] + [0] + [1]
    assert compacted.token_ids.tolist() == P6 + C6 and compacted.loss_mask.tolist() == [0] * 5 + [1] + [0] + [1]
    parents = {p.call_seq: (p.parent, p.merged, p.start) for p in detail.placements}
    assert parents == {
        0: (None, False, "first"),
        1: (0, True, None),
        2: (None, False, "no_prefix"),
        3: (1, True, None),
        4: (2, True, None),
        5: (None, False, "no_prefix"),
        6: (5, True, None),
    }
    # Each break is classified against the earlier call sharing the longest common prefix: the
    # sub-agent shares [1, 2] with call 0 or 1 (the latest wins), the compaction SYSTEM with call 3.
    assert [(f.call_seq, f.previous_call_seq, f.position) for f in detail.merge_failures] == [
        (2, 1, 2),
        (5, 3, 3),
    ]
    assert result.report.merged_calls == 4 and result.report.samples == 3
    TrainingBatch.from_rollouts(result.rollouts)


def test_the_tree_does_not_depend_on_arrival_order(store):
    spans = main_sub_compaction()
    result, _ = run(store, list(reversed(spans)))
    assert [s.call_seqs for s in result.rollouts[0].samples] == [[0, 1, 3], [2, 4], [5, 6]]


def test_a_retry_trains_the_shared_prefix_once(store):
    p0, c0 = [1, 2], [10, 11]
    p1 = p0 + c0 + [3]
    c1, c2 = [12], [13, 14]  # calls 1 and 2 send the same prompt (an SDK retry, or a parallel branch)
    p3, c3 = p1 + c2 + [4], [15]  # the harness went on from call 2's answer
    spans = [call_span("r", 0, p0, c0), call_span("r", 1, p1, c1), call_span("r", 2, p1, c2), call_span("r", 3, p3, c3)]
    result, detail = run(store, spans)
    first, branch = result.rollouts[0].samples
    assert first.call_seqs == [0, 1] and first.token_ids.tolist() == p1 + c1
    assert first.loss_mask.tolist() == [0, 0, 1, 1, 0, 1]
    assert branch.call_seqs == [2, 3] and branch.token_ids.tolist() == p3 + c3
    # call 0's completion sits in the branch as context: trained once per rollout, in `first`
    assert branch.loss_mask.tolist() == [0, 0, 0, 0, 0, 1, 1, 0, 1]
    assert trained(first) + trained(branch) == c0 + c1 + c2 + c3
    placements = {p.call_seq: p for p in detail.placements}
    assert (placements[2].parent, placements[2].start, placements[2].merged) == (0, "branch", False)
    assert (placements[3].parent, placements[3].merged) == (2, True)
    assert detail.merge_failures == [] and result.report.branched_calls == 1


@pytest.mark.parametrize(
    "end_reason", [semconv.END_CLIENT_DISCONNECTED, semconv.END_UPSTREAM_ERROR, semconv.END_HELD_TIMEOUT]
)
def test_a_response_that_never_reached_the_harness_is_not_trained(store, end_reason):
    p0, c0 = [1, 2], [10]
    p1 = p0 + c0 + [3]
    lost = with_attributes(call_span("r", 1, p1, [11, 12]), agl__call__end_reason=end_reason)
    p3, c3 = p1 + [13] + [4], [14]
    spans = [call_span("r", 0, p0, c0), lost, call_span("r", 2, p1, [13]), call_span("r", 3, p3, c3)]
    result, detail = run(store, spans)
    [sample] = result.rollouts[0].samples  # the retry (call 2) continues call 0's sample
    assert sample.call_seqs == [0, 2, 3]
    assert sample.token_ids.tolist() == p3 + c3 and trained(sample) == c0 + [13] + c3
    placements = {p.call_seq: p for p in detail.placements}
    assert placements[1].sample is None and placements[1].problem == "response_not_delivered"
    assert placements[2].parent == 0 and placements[2].merged
    assert detail.problems == {"response_not_delivered": 1}


def test_a_call_from_outside_the_harness_trace_is_marked_and_the_config_decides(store_path, tmp_path):
    from agl_trainer.store import RolloutStore

    p0, c0 = [1, 2], [10]
    p2, c2 = p0 + c0 + [3], [11]
    spans = [
        with_attributes(call_span("r", 0, p0, c0), agl__call__origin=semconv.ORIGIN_HARNESS),
        with_attributes(call_span("r", 1, [7, 8], [20]), agl__call__origin=semconv.ORIGIN_FOREIGN_TRACE),
        with_attributes(call_span("r", 2, p2, c2), agl__call__origin=semconv.ORIGIN_HARNESS),
        with_attributes(call_span("r", 3, [7, 9], [21]), agl__call__origin=semconv.ORIGIN_UNTRACED),
    ]
    with RolloutStore(store_path, grace_s=0.0) as store:
        result, detail = run(store, spans)
        assert [s.call_seqs for s in result.rollouts[0].samples] == [[0, 2], [1], [3]]  # trained by default
        assert [p.origin for p in detail.placements] == ["harness", "foreign_trace", "harness", "untraced"]
        skipped = assemble(
            store, store.ready_rollouts(), AssemblyConfig(train_outside_trace=False), record_drops=False
        )
    [only] = skipped.rollouts[0].samples
    assert only.call_seqs == [0, 2] and only.token_ids.tolist() == p2 + c2
    assert skipped.details[0].problems == {"outside_trace_not_trained": 2}


def test_a_broken_prefix_in_the_middle_starts_a_sample_the_next_calls_continue(store):
    p0, c0 = [1, 2], [10, 11]
    p1, c1 = p0 + c0 + [3], [12, 13, 17, 18, 19]
    # call 2 re-encoded call 1's answer: [12, 13] became [99]; calls 3 and 4 go on from call 2
    p2, c2 = p0 + c0 + [3, 99, 17, 18, 19, 4], [14]
    p3, c3 = p2 + c2 + [5], [15]
    p4, c4 = p3 + c3 + [6], [16]
    calls = [(p0, c0), (p1, c1), (p2, c2), (p3, c3), (p4, c4)]
    result, detail = run(store, [call_span("r", seq, p, c) for seq, (p, c) in enumerate(calls)])
    first, second = result.rollouts[0].samples
    assert first.call_seqs == [0, 1] and first.token_ids.tolist() == p1 + c1
    assert second.call_seqs == [2, 3, 4] and second.token_ids.tolist() == p4 + c4
    # the broken sample's prefix holds call 0's answer as context: trained only in `first`
    assert second.loss_mask.tolist() == [0] * 10 + [1] + [0] + [1] + [0] + [1]
    [failure] = detail.merge_failures
    assert (failure.call_seq, failure.previous_call_seq, failure.position) == (2, 1, 5)
    assert failure.kind == "retokenization"
    # call 2 extends call 0's full sequence ([1, 2, 10, 11]), whose sample call 1 continues: a
    # branch of call 0 in the tree, and a failed merge onto call 1 (it went past call 1's prompt)
    assert {p.call_seq: (p.parent, p.start) for p in detail.placements}[2] == (0, "branch")


def test_contract_refuses_an_unknown_origin(store):
    span = with_attributes(call_span("r", 0, [1], [2]), agl__call__origin="somewhere")
    written = ingest(store, [span])
    assert written.violations == {"call.bad_origin": 1}


def test_parent_span_and_origin_are_stored(store):
    span = with_attributes(call_span("r", 0, [1], [2]), agl__call__origin=semconv.ORIGIN_UNTRACED)
    span.parent_span_id = b"\x01" * 8
    ingest(store, [span, rollout_span("r")])
    [call] = store.load("r").calls
    assert (call.origin, call.parent_span_id) == ("untraced", b"\x01" * 8)


def test_two_hundred_calls_of_interleaved_threads(store):
    threads: dict[int, list[int]] = {t: [1000 + t] for t in range(4)}
    spans, expected = [], {t: [] for t in range(4)}
    for seq in range(200):
        t = seq % 4
        prompt, completion = threads[t] + [2000 + seq], [3000 + seq, 3001 + seq]
        spans.append(call_span("r", seq, prompt, completion))
        threads[t] = prompt + completion
        expected[t].append(seq)
    result, detail = run(store, spans)
    samples = result.rollouts[0].samples
    assert [s.call_seqs for s in samples] == [expected[t] for t in range(4)]
    assert [s.token_ids.tolist() for s in samples] == [threads[t] for t in range(4)]
    assert len(detail.merge_failures) == 3  # threads 1..3 start without a shared prefix


def test_a_schema_1_store_is_upgraded_in_place(store_path):
    import sqlite3

    from agl_trainer.store import RolloutStore
    from agl_trainer.store.schema import SCHEMA, SCHEMA_VERSION

    # schema 1: the calls table without the columns later schemas added
    old = "\n".join(line for line in SCHEMA.splitlines() if "(schema " not in line)
    assert "origin TEXT" not in old
    with sqlite3.connect(store_path) as db:
        db.executescript(f"{old}; PRAGMA user_version=1;")
    with RolloutStore(store_path, grace_s=0.0) as store:
        span = with_attributes(call_span("r", 0, [1], [2]), agl__call__origin=semconv.ORIGIN_FOREIGN_TRACE)
        ingest(store, [span, rollout_span("r")])
        [call] = store.load("r").calls
    assert call.origin == "foreign_trace"
    with sqlite3.connect(store_path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_inspect_shows_the_forest_and_why_each_break_happened(store, store_path, capsys, monkeypatch):
    from agl_trainer.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    ingest(store, [*main_sub_compaction(), reward_span("r", 1.0), rollout_span("r")])
    assert main(["traces", "inspect", "r", "--store", str(store_path)]) == 0
    out = capsys.readouterr().out
    tree = out[out.index("call tree") :].splitlines()
    main, sub, compaction = (next(line for line in tree if marker in line) for marker in ("0 → 1 → 3", "2 → 4", "5 → 6"))
    depth = [len(line) - len(line.lstrip(" │├└─")) for line in (main, sub, compaction)]
    assert depth[0] == depth[1] == depth[2]  # three roots: the main thread, the sub-agent, the compaction
    assert "sample 0" in main and "sample 1" in sub and "sample 2" in compaction
    assert "break vs call 1: other at token 2" in sub and "break vs call 3: other at token 3" in compaction
    assert "merged onto call 3" not in out and "merged onto call 1" in out
    assert "extends no earlier call" in out


def test_agl_train_config_has_the_assembly_section_and_names_a_bad_key():
    from agl_trainer.config import ConfigError, validate

    assert validate({"assembly": {"train_outside_trace": False}}).assembly.train_outside_trace is False
    assert validate({}).assembly.train_outside_trace is True  # documented default: trained
    with pytest.raises(ConfigError, match="assembly.train_outside_trace"):
        validate({"assembly": {"train_outside_trace": "sometimes"}})
    with pytest.raises(ConfigError, match="did you mean assembly.train_outside_trace"):
        validate({"assembly": {"train_outside_traces": False}})


def test_inspect_nests_a_branch_under_its_thread_and_keeps_a_long_thread_on_one_line(
    store, store_path, capsys, monkeypatch
):
    from agl_trainer.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    p0, c0 = [1, 2], [10, 11]
    p1 = p0 + c0 + [3]
    spans = [call_span("r", 0, p0, c0), call_span("r", 1, p1, [12]), call_span("r", 2, p1, [13])]
    sequence = p1 + [12]
    for seq in range(3, 1200):  # the main thread goes on from call 1 for a long time
        prompt = sequence + [4]
        spans.append(call_span("r", seq, prompt, [5]))
        sequence = prompt + [5]
    ingest(store, [*spans, reward_span("r", 1.0), rollout_span("r")])
    assert main(["traces", "inspect", "r", "--store", str(store_path), "--max-tokens", "20"]) == 0
    tree = capsys.readouterr().out.split("call tree")[1].splitlines()
    [thread] = [line for line in tree if "calls 0 → 1 → 3 → 4" in line]
    [branch] = [line for line in tree if line.lstrip(" │├└─").startswith("call 2 ")]
    assert "a branch of call 0" in branch
    assert len(branch) - len(branch.lstrip(" │├└─")) > len(thread) - len(thread.lstrip(" │├└─"))
    assert "0 → 1 → 3 → 4 → … → 1197 → 1198 → 1199 (1199 calls)" in thread


@st.composite
def forest_spans(draw) -> list[Span]:
    """A rollout whose calls continue, retry or restart any earlier call (by reference or whole),
    some from outside the harness's trace, some never delivered; then its reward and end."""
    calls: list[tuple[list[int], list[int]]] = []
    spans = []
    small = st.lists(st.integers(0, 5), max_size=3)
    for seq in range(draw(st.integers(1, 7))):
        how = draw(st.sampled_from(["root", "continue", "retry"])) if calls else "root"
        completion = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
        if how == "root":
            prompt, span = [draw(st.integers(0, 5)), *draw(small)], None
        else:
            earlier = draw(st.integers(0, len(calls) - 1))
            base_prompt, base_completion = calls[earlier]
            prompt = base_prompt if how == "retry" else base_prompt + base_completion + draw(small)
            if how == "continue" and draw(st.booleans()):  # sent by reference to that call
                full = len(base_prompt) + len(base_completion)
                suffix = prompt[full:]
                span = call_span("r", seq, suffix, completion, ref=(earlier, full), prompt_length=len(prompt))
            else:
                span = None
        span = span or call_span("r", seq, prompt, completion)
        extra = draw(st.sampled_from([{}, {"agl__call__origin": "untraced"}, {"agl__call__end_reason": "upstream_error"}]))
        spans.append(with_attributes(span, **extra))
        calls.append((prompt, completion))
    return [*spans, reward_span("r", 0.5), rollout_span("r")]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_forest_assembles_the_same_whatever_the_arrival_order(data, tmp_path_factory):
    from agl_trainer.store import RolloutStore

    spans = data.draw(forest_spans())
    order = data.draw(st.permutations(spans))
    outcomes = []
    for arrival in (spans, order):
        path = tmp_path_factory.mktemp("forest") / "store.db"
        with RolloutStore(path, grace_s=0.0) as store:
            for span in arrival:
                ingest(store, [span])
            result = assemble(store, store.ready_rollouts(), AssemblyConfig(missing_reward=0.0))
            outcomes.append((result.rollouts, result.details[0].placements, result.details[0].merge_failures))
    assert outcomes[0] == outcomes[1]
