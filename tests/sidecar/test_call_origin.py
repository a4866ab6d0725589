"""Attribution inside a rollout: concurrent calls are all recorded with their W3C parents, and calls
from outside the harness's trace are marked (agl.call.origin)."""

from __future__ import annotations

import asyncio

import httpx

from agl import semconv
from agl_sidecar.calls.attribution import Identity, RolloutTraces, TraceParent

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
HARNESS_TRACE = "ab" * 16


def traceparent(trace: str, span: str) -> str:
    return f"00-{trace}-{span}-01"


async def _calls(url: str) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        # the harness: its first call sets the rollout's trace, then four sub-agents at once
        first = await client.post(url, json=BODY, headers={"traceparent": traceparent(HARNESS_TRACE, "01" * 8)})
        first.raise_for_status()
        answers = await asyncio.gather(
            *(
                client.post(url, json=BODY, headers={"traceparent": traceparent(HARNESS_TRACE, f"{i + 2:02x}" * 8)})
                for i in range(4)
            )
        )
        assert all(answer.status_code == 200 for answer in answers)
        # a process the agent spawned: no trace context, then a trace of its own
        (await client.post(url, json=BODY)).raise_for_status()
        other = traceparent("cd" * 16, "0f" * 8)
        (await client.post(url, json=BODY, headers={"traceparent": other})).raise_for_status()


def test_concurrent_calls_keep_their_parents_and_outside_calls_are_marked(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    asyncio.run(_calls(sidecar.url + "/rollouts/r-tree/v1/chat/completions"))
    httpx.post(sidecar.url + "/rollouts/r-plain/v1/chat/completions", json=BODY).raise_for_status()
    spans = otlp_sink.wait_for(lambda spans: len(spans) >= 8)
    tree = sorted((s for s in spans if s.rollout_id == "r-tree"), key=lambda s: s.attributes[semconv.CALL_SEQ])
    assert len(tree) == 7
    harness = [s for s in tree if s.trace_id == HARNESS_TRACE]
    assert sorted(s.parent_span_id for s in harness) == [f"{i:02x}" * 8 for i in range(1, 6)]
    assert {s.attributes[semconv.CALL_ORIGIN] for s in harness} == {semconv.ORIGIN_HARNESS}
    untraced, foreign = tree[5:]
    assert untraced.parent_span_id == "" and untraced.attributes[semconv.CALL_ORIGIN] == semconv.ORIGIN_UNTRACED
    assert foreign.parent_span_id == "0f" * 8
    assert foreign.attributes[semconv.CALL_ORIGIN] == semconv.ORIGIN_FOREIGN_TRACE
    # a harness that sends no trace context at all: nothing to compare, its calls are the harness's
    [plain] = [s for s in spans if s.rollout_id == "r-plain"]
    assert plain.attributes[semconv.CALL_ORIGIN] == semconv.ORIGIN_HARNESS


def test_each_attempt_has_its_own_trace_and_an_ended_rollout_forgets_it():
    traces = RolloutTraces(max_rollouts=2)
    one, two = TraceParent(b"\x01" * 16, b"\x01" * 8), TraceParent(b"\x02" * 16, b"\x01" * 8)
    attempt0, attempt1 = Identity("r", attempt=0), Identity("r", attempt=1)
    assert traces.origin(attempt0, one) == semconv.ORIGIN_HARNESS
    assert traces.origin(attempt1, two) == semconv.ORIGIN_HARNESS  # a retried attempt: a new harness
    assert traces.origin(attempt0, two) == semconv.ORIGIN_FOREIGN_TRACE
    assert traces.origin(attempt1, None) == semconv.ORIGIN_UNTRACED
    assert traces.origin(Identity(None), one) is None
    traces.forget(attempt0)
    assert traces.origin(attempt0, two) == semconv.ORIGIN_HARNESS
    traces.origin(Identity("s"), one)  # bounded: the least recently used rollout goes
    assert traces.origin(attempt1, None) == semconv.ORIGIN_HARNESS
