"""Rewards as the OpenTelemetry GenAI conventions say them: a `gen_ai.evaluation.result` span with
agl.rollout.id is a reward of its rollout (docs/spans.md), through a real collector (rotel-agent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from agl import semconv
from agl_trainer.receiver.contract import classify
from agl_trainer.receiver.raw_span import RawSpan
from agl_trainer.store import RolloutStore
from agl_trainer.store.records import RewardSpan, Violation

from tests.dataplane.otlp import call_span, request, reward_span, rollout_span, span
from tests.dataplane.processes import receive_behind_rotel


def evaluation(rollout_id: str | None, **attributes: object) -> RawSpan:
    attrs = dict(attributes)
    if rollout_id is not None:
        attrs[semconv.ROLLOUT_ID] = rollout_id
    return RawSpan(os.urandom(16), os.urandom(8), b"", semconv.SPAN_EVALUATION_RESULT, 1, 1, 2, 0, "", attrs)


def test_evaluation_result_is_a_reward_named_by_the_evaluation() -> None:
    record = classify(evaluation("r1", **{semconv.EVALUATION_NAME: "reward", semconv.EVALUATION_SCORE_VALUE: 0.75}))
    assert isinstance(record, RewardSpan)
    assert (record.rollout_id, record.name, record.value) == ("r1", "reward", 0.75)
    labelled = classify(evaluation("r1", **{semconv.EVALUATION_NAME: "tests", semconv.EVALUATION_SCORE_LABEL: "Fail"}))
    assert isinstance(labelled, RewardSpan) and (labelled.name, labelled.value) == ("tests", 0.0)
    # the score wins over the label when both are there
    both = classify(
        evaluation("r1", **{semconv.EVALUATION_NAME: "q", semconv.EVALUATION_SCORE_VALUE: 3.0,
                            semconv.EVALUATION_SCORE_LABEL: "fail"})
    )  # fmt: skip
    assert isinstance(both, RewardSpan) and both.value == 3.0


@pytest.mark.parametrize(
    ("attributes", "reason"),
    [
        ({semconv.EVALUATION_SCORE_VALUE: 1.0}, "reward.missing_gen_ai_evaluation_name"),
        ({semconv.EVALUATION_NAME: "reward"}, "reward.missing_reward_value"),
        ({semconv.EVALUATION_NAME: "reward", semconv.EVALUATION_SCORE_LABEL: "meh"}, "reward.evaluation_label_unknown"),
        ({semconv.EVALUATION_NAME: "reward", semconv.EVALUATION_SCORE_VALUE: float("nan")}, "reward.reward_value_not_finite"),
        ({semconv.EVALUATION_NAME: "reward", semconv.EVALUATION_SCORE_VALUE: "1"}, "reward.reward_value_not_number"),
    ],
)
def test_bad_evaluation_results_are_violations_named(attributes: dict[str, object], reason: str) -> None:
    record = classify(evaluation("r1", **attributes))
    assert isinstance(record, Violation) and record.reason == reason


def test_an_evaluation_of_no_rollout_is_foreign() -> None:
    assert classify(evaluation(None, **{semconv.EVALUATION_NAME: "reward", semconv.EVALUATION_SCORE_VALUE: 1.0})) is None


def test_evaluation_result_through_rotel_lands_on_its_rollout(tmp_path: Path) -> None:
    with receive_behind_rotel(tmp_path, "http") as receiving:
        start = 1_700_000_000_000_000_000
        spans = [
            call_span("graded", 0, [1, 2, 3], [4, 5]),
            # an agl.reward of 0.2, then an evaluation result for the same name that ended later: it wins
            reward_span("graded", 0.2, end_ns=start + 10),
            span(
                semconv.SPAN_EVALUATION_RESULT,
                {semconv.ROLLOUT_ID: "graded", semconv.ATTEMPT: 0, semconv.EVALUATION_NAME: "reward",
                 semconv.EVALUATION_SCORE_VALUE: 0.9, semconv.EVALUATION_EXPLANATION: "tests pass"},
                start_ns=start, end_ns=start + 20,
            ),
            span(
                semconv.SPAN_EVALUATION_RESULT,
                {semconv.ROLLOUT_ID: "graded", semconv.EVALUATION_NAME: "style", semconv.EVALUATION_SCORE_LABEL: "pass"},
            ),
            rollout_span("graded"),
        ]  # fmt: skip
        receiving.post_traces(request(spans).SerializeToString(), gzipped=True)
        receiving.wait_stored(5)
        with RolloutStore(receiving.store, grace_s=0.0) as store:
            data = store.load("graded")
            assert data.final_reward("reward") == 0.9
            assert data.final_reward("style") == 1.0
            assert [r.rollout_id for r in store.ready_rollouts()] == ["graded"]
