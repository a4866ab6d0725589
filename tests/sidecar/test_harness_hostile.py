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
