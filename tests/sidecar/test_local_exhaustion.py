"""Out of file descriptors on the sidecar's host (EMFILE on connect: half-sent requests holding
descriptors, a low `ulimit -n`) is the sidecar's own limit, not the engine's fault: the call waits a
little for a descriptor, then gets 503 with Retry-After, and the engine stays in service, so the
calls after it are not sent elsewhere or failed. Before, it took the upstream out as if it were down."""

from __future__ import annotations

import threading

import httpx

from agl import semconv
from agl_sidecar.proxy import engine_client

from tests.sidecar.test_engine_client import descriptors_exhausted
from tests.support.waiting import wait_until

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 2}


def test_emfile_on_connect_is_a_503_and_the_engine_stays_in_service(fake, make_sidecar, otlp_sink, monkeypatch):
    monkeypatch.setattr(engine_client, "LOCAL_WAIT_S", 0.3)
    # Spans are sent only when asked (a drained pause), after descriptors are back.
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint, health_interval_s=3600,
                           export_interval_s=3600)
    url = sidecar.url
    # Connections opened now, reused while no descriptor can be opened: the admin's and the harness's.
    with httpx.Client(timeout=60) as admin, httpx.Client(timeout=60) as harness:
        assert admin.get(url + "/agl/v1/state").status_code == 200
        assert harness.get(url + "/healthz").status_code == 200
        admin.post(url + "/agl/v1/pause", json={})
        answers: list[httpx.Response] = []
        call = threading.Thread(target=lambda: answers.append(harness.post(url + "/rollouts/r/v1/chat/completions",
                                                                           json=CHAT)))  # fmt: skip
        call.start()
        wait_until(lambda: sidecar.sidecar.gate.held == 1, "the call held")
        sidecar.sidecar.engines._idle.clear()  # no pooled engine connection: the call must connect
        with descriptors_exhausted():
            admin.post(url + "/agl/v1/resume", json={})
            call.join(60)
        (answer,) = answers
        assert answer.status_code == 503 and answer.headers["Retry-After"] == "1"
        assert "file descriptors" in answer.json()["error"]["message"]
        assert sidecar.sidecar.router.upstreams[0].healthy  # not taken out: the engine did nothing wrong
        assert harness.post(url + "/rollouts/r/v1/chat/completions", json=CHAT).status_code == 200
        assert admin.post(url + "/agl/v1/pause", json={"drain": True}).json()["spans_flushed"] is True
        admin.post(url + "/agl/v1/resume", json={})
    spans = otlp_sink.wait_for(lambda spans: len(spans) >= 2)
    reasons = sorted(s.attributes[semconv.CALL_END_REASON] for s in spans)
    assert reasons == [semconv.END_COMPLETED, semconv.END_UPSTREAM_ERROR]
