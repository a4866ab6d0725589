"""Pause / drain / resume under load, held-call timeout, admin auth, rewards, /metrics."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agl import semconv
from agl_testing.fake_vllm import FakeVLLM
from tests.support.waiting import wait_until, wait_until_async

MESSAGES = [{"role": "user", "content": "go"}]


async def test_pause_with_50_rollouts_mid_flight_then_resume(make_sidecar, otlp_sink):
    with FakeVLLM(latency_s=0.3) as fake:
        sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
        url = sidecar.url
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8}
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as http:

            async def rollout(i: int) -> list[int]:
                statuses = []
                for _ in range(2):
                    r = await http.post(f"{url}/rollouts/r{i}/v1/chat/completions", json=body)
                    statuses.append(r.status_code)
                return statuses

            tasks = [asyncio.create_task(rollout(i)) for i in range(50)]
            await wait_until_async(lambda: fake.active >= 50, "50 calls at the engine")  # first calls are in flight at the engine
            paused = (await http.post(f"{url}/agl/v1/pause", json={"drain": True, "timeout_s": 30})).json()
            # Drained: every first call finished; every second call is held, none failed.
            assert paused["paused"] is True and paused["in_flight"] == 0 and paused["policy_version"] == 0
            await wait_until_async(lambda: sidecar.sidecar.gate.held == 50, "50 calls held")
            state = (await http.get(f"{url}/agl/v1/state")).json()
            assert state["held"] == 50 and state["in_flight"] == 0 and len(fake.requests) == 50
            resumed = (await http.post(f"{url}/agl/v1/resume", json={"policy_version": 1})).json()
            assert resumed == {"paused": False, "in_flight": resumed["in_flight"], "held": 0, "policy_version": 1}
            results = await asyncio.gather(*tasks)
        assert all(statuses == [200, 200] for statuses in results)
        spans = otlp_sink.wait_for(lambda spans: len(spans) >= 100)
        for i in range(50):
            first, second = sorted(
                (s for s in spans if s.rollout_id == f"r{i}"), key=lambda s: s.attributes[semconv.CALL_SEQ]
            )
            assert first.attributes[semconv.POLICY_VERSION] == 0 and second.attributes[semconv.POLICY_VERSION] == 1
            assert second.attributes[semconv.CALL_HELD_MS] > 0  # first calls v0, held calls v1


async def test_drained_pause_answers_after_the_drained_calls_spans_are_sent(make_sidecar, otlp_sink):
    # The trainer assembles right after a drained pause; a span still queued then would be missing.
    # A 30 s export interval: only the pause's flush can have sent these spans when it answers.
    with FakeVLLM(latency_s=0.2) as fake:
        sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint, export_interval_s=30)
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8}
        async with httpx.AsyncClient(timeout=30) as http:
            calls = [
                asyncio.create_task(http.post(f"{sidecar.url}/rollouts/f{i}/v1/chat/completions", json=body))
                for i in range(8)
            ]
            await wait_until_async(lambda: fake.active >= 8, "8 calls at the engine")
            paused = (await http.post(f"{sidecar.url}/agl/v1/pause", json={"drain": True, "timeout_s": 30})).json()
            assert paused["in_flight"] == 0 and paused["spans_flushed"] is True
            sent = {span.attributes[semconv.ROLLOUT_ID] for span in otlp_sink.named(semconv.call_span_name("chat", "tiny"))}
            assert sent == {f"f{i}" for i in range(8)}
            assert all(r.status_code == 200 for r in await asyncio.gather(*calls))
            await http.post(f"{sidecar.url}/agl/v1/resume", json={})


async def test_held_call_times_out_with_503_and_retry_after(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint, max_hold_s=0.3)
    async with httpx.AsyncClient(timeout=10) as http:
        await http.post(f"{sidecar.url}/agl/v1/pause", json={})
        r = await http.post(f"{sidecar.url}/rollouts/h/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
        assert r.status_code == 503 and "Retry-After" in r.headers
        assert r.json()["error"]["code"] == 503
        await http.post(f"{sidecar.url}/agl/v1/resume", json={})
        ok = await http.post(f"{sidecar.url}/rollouts/h/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
        assert ok.status_code == 200
    spans = otlp_sink.wait_for(lambda spans: len(spans) >= 2)
    reasons = sorted(s.attributes[semconv.CALL_END_REASON] for s in spans)
    assert reasons == [semconv.END_COMPLETED, semconv.END_HELD_TIMEOUT]


async def test_drain_timeout_answers_504_and_stays_paused(make_sidecar):
    with FakeVLLM(latency_s=2.0) as fake:
        sidecar = make_sidecar(upstream=[fake.base_url])
        async with httpx.AsyncClient(timeout=10) as http:
            call = asyncio.create_task(
                http.post(f"{sidecar.url}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
            )
            await wait_until_async(lambda: fake.active == 1, "1 call at the engine")
            r = await http.post(f"{sidecar.url}/agl/v1/pause", json={"drain": True, "timeout_s": 0.1})
            assert r.status_code == 504 and r.json()["paused"] is True and r.json()["in_flight"] == 1
            await http.post(f"{sidecar.url}/agl/v1/resume", json={})
            assert (await call).status_code == 200


def test_admin_token_and_bad_admin_bodies(fake, make_sidecar):
    sidecar = make_sidecar(upstream=[fake.base_url], admin_token="t0ken")
    assert httpx.get(sidecar.url + "/agl/v1/state").status_code == 401
    assert httpx.get(sidecar.url + "/agl/v1/state", headers={"Authorization": "Bearer wrong"}).status_code == 401
    auth = {"Authorization": "Bearer t0ken"}
    state = httpx.get(sidecar.url + "/agl/v1/state", headers=auth).json()
    assert state["paused"] is False and state["upstreams"] == [fake.base_url] and "spans_exported" in state["counters"]
    bad = httpx.post(sidecar.url + "/agl/v1/pause", json={"drain": "yes"}, headers=auth)
    assert bad.status_code == 400 and "drain" in bad.json()["error"]
    bad = httpx.post(sidecar.url + "/agl/v1/resume", json={"upstreams": ["ftp://x"]}, headers=auth)
    assert bad.status_code == 400 and "http://" in bad.json()["error"]
    # Model calls do not need the admin token.
    ok = httpx.post(sidecar.url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
    assert ok.status_code == 200


def test_resume_with_new_upstreams_moves_calls(make_sidecar):
    with FakeVLLM() as first, FakeVLLM() as second:
        sidecar = make_sidecar(upstream=[first.base_url])
        httpx.post(sidecar.url + "/agl/v1/pause", json={})
        r = httpx.post(sidecar.url + "/agl/v1/resume", json={"policy_version": 5, "upstreams": [second.base_url + "/v1"]})
        assert r.json()["policy_version"] == 5
        httpx.post(sidecar.url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
        assert len(first.requests) == 0 and len(second.requests) == 1


def test_sticky_routing_and_failover(make_sidecar):
    with FakeVLLM() as a, FakeVLLM() as b, httpx.Client() as http:
        sidecar = make_sidecar(upstream=[a.base_url, b.base_url])
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
        for i in range(20):
            for _ in range(3):
                http.post(f"{sidecar.url}/rollouts/r{i}/v1/chat/completions", json=body)
        # Each rollout's three calls went to one replica; both replicas got some rollouts.
        assert len(a.requests) % 3 == 0 and len(b.requests) % 3 == 0
        assert a.requests and b.requests
        a.healthy = False
        wait_until(lambda: not sidecar.sidecar.router.upstreams[0].healthy, "replica a marked unhealthy", timeout=10)
        before = len(a.requests)
        for i in range(20):
            assert http.post(f"{sidecar.url}/rollouts/r{i}/v1/chat/completions", json=body).status_code == 200
        assert len(a.requests) == before and len(b.requests) >= 20
        state = http.get(sidecar.url + "/agl/v1/state").json()
        assert state["upstream_health"] == {a.base_url: False, b.base_url: True}


def test_reward_and_end_endpoints_emit_sdk_shaped_spans(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    base = sidecar.url + "/rollouts/rw/attempts/2"
    r = httpx.post(base + "/reward", json={"value": 0.5, "name": "accuracy", "call_seq": 0})
    assert r.status_code == 200
    assert httpx.post(base + "/end", json={"status": "failed", "task_id": "t7"}).status_code == 200
    assert httpx.post(base + "/reward", json={"value": "high"}).status_code == 400
    assert httpx.post(base + "/reward", content=b'{"value": 1e999}').status_code == 400
    assert httpx.post(base + "/end", json={"status": "done"}).status_code == 400
    spans = otlp_sink.wait_for(lambda spans: len(spans) >= 2)
    (reward,) = [s for s in spans if s.name == semconv.SPAN_REWARD]
    assert reward.attributes == {
        semconv.ROLLOUT_ID: "rw",
        semconv.ATTEMPT: 2,
        semconv.REWARD_NAME: "accuracy",
        semconv.REWARD_VALUE: 0.5,
        semconv.CALL_SEQ: 0,
    }
    (end,) = [s for s in spans if s.name == semconv.SPAN_ROLLOUT]
    assert end.attributes[semconv.ROLLOUT_STATUS] == semconv.STATUS_FAILED
    assert end.attributes[semconv.TASK_ID] == "t7" and end.attributes[semconv.ROLLOUT_MODE] == "train"


def test_metrics_and_healthz(fake, make_sidecar):
    sidecar = make_sidecar(upstream=[fake.base_url])
    httpx.post(sidecar.url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
    assert httpx.get(sidecar.url + "/healthz").json() == {"status": "ok"}
    text = httpx.get(sidecar.url + "/metrics").text
    assert 'agl_sidecar_requests_total{api="openai.chat_completions",status="200"} 1' in text
    assert 'agl_sidecar_request_duration_seconds_count{api="openai.chat_completions"} 1' in text
    for name in ("agl_sidecar_in_flight", "agl_sidecar_held", "agl_sidecar_spans_exported_total",
                 "agl_sidecar_spans_spooled_total", "agl_sidecar_spans_failed_total", "agl_sidecar_bytes_exported_total"):
        assert name in text
    for _ in range(3):  # more calls, one after another: the engine's keep-alive connection is reused
        httpx.post(sidecar.url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
    text = httpx.get(sidecar.url + "/metrics").text
    families = {family.name: family for family in text_string_to_metric_families(text)}  # the exposition, parsed
    opened = families["agl_sidecar_engine_connections_opened"]
    assert opened.type == "counter"
    assert [(s.name, s.value) for s in opened.samples] == [("agl_sidecar_engine_connections_opened_total", 1.0)]
    idle = families["agl_sidecar_engine_connections_idle"]
    assert idle.type == "gauge" and [s.value for s in idle.samples] == [1.0]
