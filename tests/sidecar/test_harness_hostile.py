"""The harness routes (/rollouts/{id}/reward, /end) against values JSON allows but a span cannot carry."""

from __future__ import annotations

import httpx


def test_a_reward_too_large_for_a_double_is_a_400_naming_the_value(fake, make_sidecar, otlp_sink):
    # Before: float() of the int msgspec decoded raised OverflowError: a 500 and a traceback.
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    body = b'{"value": 1' + b"0" * 400 + b"}"
    answer = httpx.post(sidecar.url + "/rollouts/r1/reward", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "value" and "finite number" in error["message"]
    ok = httpx.post(sidecar.url + "/rollouts/r1/reward", json={"value": 10**300})  # large, but a double
    assert ok.status_code == 200
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
    assert span.attributes["agl.reward.value"] == 1e300


def test_ids_over_the_bound_are_a_400_naming_where_they_came_from(fake, make_sidecar, otlp_sink):
    # Before: a 1 MB rollout id was accepted, and went into every span of its rollout.
    from agl import semconv

    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    long = "r" * (semconv.ROLLOUT_ID_MAX_CHARS + 1)
    huge = "r" * 1_000_000
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "go"}]}
    cases = [
        (f"/rollouts/{long}/v1/chat/completions", chat, {}, "rollout id in the URL path"),
        ("/v1/chat/completions", chat, {"x-agl-rollout-id": long}, "x-agl-rollout-id"),
        ("/v1/chat/completions", chat, {"baggage": f"agl.rollout.id={long}"}, "baggage agl.rollout.id"),
        ("/rollouts/r/v1/chat/completions", chat, {"x-agl-task-id": long}, "x-agl-task-id"),
        (f"/rollouts/{long}/reward", {"value": 1.0}, {}, "rollout id in the URL path"),
        ("/rollouts/r/reward", {"value": 1.0, "task_id": huge}, {}, "task_id"),
        ("/rollouts/r/end", {"task_id": huge}, {}, "task_id"),
    ]
    for path, body, headers, param in cases:
        answer = httpx.post(sidecar.url + path, json=body, headers=headers, timeout=30)
        assert answer.status_code == 400, (path, headers.keys(), answer.text[:200])
        error = answer.json()["error"]
        assert error["param"] == param and f"at most {semconv.ROLLOUT_ID_MAX_CHARS}" in error["message"]
        assert len(answer.content) < 2000
    assert fake.requests == []
    longest = "r" * semconv.ROLLOUT_ID_MAX_CHARS  # at the bound: served and recorded
    assert httpx.post(sidecar.url + f"/rollouts/{longest}/v1/chat/completions", json=chat).status_code == 200
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
    assert span.attributes[semconv.ROLLOUT_ID] == longest
