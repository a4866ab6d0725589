"""The SDK's spans, as they arrive at a real OTLP/HTTP receiver."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

import agl
from agl import semconv
from tests.support.otlp_sink import OTLPSink


@pytest.fixture
def sink(otlp_sink: OTLPSink, monkeypatch: pytest.MonkeyPatch) -> Iterator[OTLPSink]:
    for name in (semconv.ENV_ROLLOUT_ID, semconv.ENV_TASK_ID, semconv.ENV_ATTEMPT, semconv.ENV_MODE):
        monkeypatch.delenv(name, raising=False)
    agl.init(endpoint=otlp_sink.endpoint, service_name="sdk-test")
    yield otlp_sink
    agl.init(endpoint=otlp_sink.endpoint)  # drops this test's provider (flushes and shuts it down)


def test_rollout_and_reward_spans_carry_the_contract(sink: OTLPSink) -> None:
    with agl.rollout(rollout_id="r-1", task_id="task-7", attempt=2, mode="val"):
        agl.emit_reward(0.75)
        agl.emit_reward(1.0, name="tests_passed", call_seq=3, attributes={"grader": "pytest"})
    assert agl.flush()
    spans = sink.wait_for(lambda spans: len(spans) == 3)
    rollout = next(span for span in spans if span.name == semconv.SPAN_ROLLOUT)
    assert rollout.attributes == {
        semconv.ROLLOUT_ID: "r-1",
        semconv.TASK_ID: "task-7",
        semconv.ATTEMPT: 2,
        semconv.ROLLOUT_MODE: "val",
        semconv.ROLLOUT_STATUS: semconv.STATUS_SUCCEEDED,
    }
    assert rollout.resource["service.name"] == "sdk-test"
    rewards = {span.attributes[semconv.REWARD_NAME]: span for span in spans if span.name == semconv.SPAN_REWARD}
    assert rewards["reward"].attributes[semconv.REWARD_VALUE] == 0.75
    assert rewards["reward"].raw_attribute_kinds[semconv.REWARD_VALUE] == "double_value"
    assert rewards["reward"].attributes[semconv.ROLLOUT_ID] == "r-1"
    assert rewards["reward"].attributes[semconv.TASK_ID] == "task-7"
    assert rewards["reward"].attributes[semconv.ATTEMPT] == 2
    assert semconv.CALL_SEQ not in rewards["reward"].attributes
    assert rewards["tests_passed"].attributes[semconv.CALL_SEQ] == 3
    assert rewards["tests_passed"].attributes["grader"] == "pytest"
    # One rollout is one trace: rewards are children of the rollout span.
    for reward in rewards.values():
        assert reward.trace_id == rollout.trace_id
        assert reward.parent_span_id == rollout.span_id


def test_dict_reward_emits_one_span_per_name(sink: OTLPSink) -> None:
    agl.emit_reward({"reward": 1, "format": 0.5}, rollout_id="r-dict")
    agl.flush()
    spans = sink.wait_for(lambda spans: len(spans) == 2)
    assert {(s.attributes[semconv.REWARD_NAME], s.attributes[semconv.REWARD_VALUE]) for s in spans} == {
        ("reward", 1.0),
        ("format", 0.5),
    }
    assert all(s.attributes[semconv.ROLLOUT_ID] == "r-dict" for s in spans)


def test_failed_rollout_is_marked_failed_and_the_error_propagates(sink: OTLPSink) -> None:
    with pytest.raises(KeyError):
        with agl.rollout(rollout_id="r-fail"):
            raise KeyError("boom")
    agl.flush()
    (span,) = sink.wait_for(lambda spans: len(spans) == 1)
    assert span.attributes[semconv.ROLLOUT_STATUS] == semconv.STATUS_FAILED
    assert span.status_code == 2  # STATUS_CODE_ERROR


def test_decorator_on_sync_and_async_functions_makes_a_rollout_per_call(sink: OTLPSink) -> None:
    @agl.rollout(task_id="t-sync")
    def run_sync() -> str:
        agl.emit_reward(1.0)
        current = agl.current_rollout()
        assert current is not None
        return current.rollout_id

    @agl.rollout
    async def run_async() -> str:
        await asyncio.sleep(0)
        agl.emit_reward(0.0)
        current = agl.current_rollout()
        assert current is not None
        return current.rollout_id

    first, second = run_sync(), run_sync()
    third = asyncio.run(run_async())
    assert len({first, second, third}) == 3
    agl.flush()
    spans = sink.wait_for(lambda spans: len(spans) == 6)
    rollout_ids = {s.attributes[semconv.ROLLOUT_ID] for s in spans if s.name == semconv.SPAN_ROLLOUT}
    reward_ids = {s.attributes[semconv.ROLLOUT_ID] for s in spans if s.name == semconv.SPAN_REWARD}
    assert rollout_ids == reward_ids == {first, second, third}


def test_async_context_manager_and_concurrent_rollouts_keep_their_own_ids(sink: OTLPSink) -> None:
    async def one(index: int) -> None:
        async with agl.rollout(rollout_id=f"r-{index}"):
            await asyncio.sleep(0.01 * (5 - index))
            agl.emit_reward(float(index))

    async def main() -> None:
        await asyncio.gather(*(one(i) for i in range(5)))

    asyncio.run(main())
    agl.flush()
    spans = sink.wait_for(lambda spans: len(spans) == 10)
    for span in spans:
        if span.name == semconv.SPAN_REWARD:
            assert span.attributes[semconv.ROLLOUT_ID] == f"r-{int(span.attributes[semconv.REWARD_VALUE])}"


def test_ids_default_from_the_runner_environment(sink: OTLPSink, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(semconv.ENV_ROLLOUT_ID, "from-env")
    monkeypatch.setenv(semconv.ENV_TASK_ID, "task-env")
    monkeypatch.setenv(semconv.ENV_ATTEMPT, "4")
    agl.emit_reward(0.25)  # no rollout context: the environment names it
    with agl.rollout() as r:
        assert (r.rollout_id, r.task_id, r.attempt) == ("from-env", "task-env", 4)
    agl.flush()
    spans = sink.wait_for(lambda spans: len(spans) == 2)
    assert all(s.attributes[semconv.ROLLOUT_ID] == "from-env" for s in spans)
    assert all(s.attributes[semconv.ATTEMPT] == 4 for s in spans)


def test_headers_and_base_url_attribute_calls_to_the_rollout(sink: OTLPSink) -> None:
    from opentelemetry import baggage
    from opentelemetry.baggage.propagation import W3CBaggagePropagator

    with agl.rollout(rollout_id="r-h", task_id="t", attempt=1) as r:
        headers = r.headers()
        assert r.base_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/rollouts/r-h/attempts/1/v1"
        assert r.base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/rollouts/r-h/attempts/1/v1"
    assert headers[semconv.HEADER_ROLLOUT_ID] == "r-h"
    assert headers[semconv.HEADER_TASK_ID] == "t"
    ctx = W3CBaggagePropagator().extract(headers)
    assert baggage.get_baggage(semconv.BAGGAGE_ROLLOUT_ID, ctx) == "r-h"
    agl.flush()
    (rollout,) = sink.wait_for(lambda spans: len(spans) == 1)
    version, trace_id, parent_id, _flags = headers["traceparent"].split("-")
    assert (trace_id, parent_id) == (rollout.trace_id, rollout.span_id)
    assert agl.rollout(rollout_id="r0").base_url("https://x.example/") == "https://x.example/rollouts/r0/v1"


def test_traceparent_from_the_environment_parents_the_rollout(
    sink: OTLPSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    monkeypatch.setenv(semconv.ENV_TRACEPARENT, f"00-{trace_id}-{parent}-01")
    with agl.rollout(rollout_id="child"):
        pass
    agl.flush()
    (span,) = sink.wait_for(lambda spans: len(spans) == 1)
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent)
