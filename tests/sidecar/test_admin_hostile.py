"""The admin API against values a caller may get wrong: each is a 400 naming the value (never at
length), never a 500; a refused resume changes nothing but the gate, which it opens under the
version in force."""

from __future__ import annotations

import httpx
import pytest


@pytest.mark.parametrize("url", ["http://[::1", "http://user:secret@[::1:8000", "https://[fe80::1%25eth0"])
def test_resume_with_an_upstream_url_python_cannot_split_is_a_400_naming_it(fake, make_sidecar, url):
    # Before: urlsplit's ValueError ("Invalid IPv6 URL") escaped the route: a 500 and a traceback.
    sidecar = make_sidecar(upstream=[fake.base_url])
    answer = httpx.post(sidecar.url + "/agl/v1/resume", json={"upstreams": [fake.base_url, url]})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert "not a valid URL" in error and "secret" not in error
    assert httpx.get(sidecar.url + "/agl/v1/state").json()["upstreams"] == [fake.base_url]  # unchanged


MESSAGES = [{"role": "user", "content": "go"}]


@pytest.mark.parametrize(
    "body",
    [
        {"policy_version": "three"},
        {"policy_version": 3, "upstreams": ["http://gpu1..cluster:8000"]},
        {"policy_version": 3, "engine_progress": {"chatcmpl-1": 4}},  # without "switch"
        {"policy_version": 3, "bogus": "x" * 1_000_000},
    ],
)
async def test_a_refused_resume_still_opens_the_gate_under_the_version_in_force(fake, make_sidecar, body):
    # Before: the 400 left the gate paused, so every harness call waited max_hold_s and got a 503.
    import asyncio

    sidecar = make_sidecar(upstream=[fake.base_url], admin_token="t0ken", policy_version=2)
    auth = {"Authorization": "Bearer t0ken"}
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await http.post(sidecar.url + "/agl/v1/pause", json={}, headers=auth)).status_code == 200
        held = asyncio.create_task(
            http.post(sidecar.url + "/rollouts/r/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
        )
        from tests.support.waiting import wait_until_async

        await wait_until_async(lambda: sidecar.sidecar.gate.held == 1, "the call held")
        refused = await http.post(sidecar.url + "/agl/v1/resume", json=body, headers=auth)
        assert refused.status_code == 400
        answer = refused.json()
        assert answer["paused"] is False and answer["policy_version"] == 2 and "resume" in answer["error"]
        assert len(refused.content) < 2000  # the refused value is not echoed at length
        assert (await held).status_code == 200  # released under version 2, as before the pause
        assert fake.requests and sidecar.sidecar.router.urls == [fake.base_url]


def test_a_resume_without_the_admin_token_opens_nothing(fake, make_sidecar):
    sidecar = make_sidecar(upstream=[fake.base_url], admin_token="t0ken")
    assert httpx.post(sidecar.url + "/agl/v1/pause", json={}, headers={"Authorization": "Bearer t0ken"}).status_code == 200
    assert httpx.post(sidecar.url + "/agl/v1/resume", json={"x": 1}).status_code == 401
    assert httpx.post(sidecar.url + "/agl/v1/resume", json={}, headers={"Authorization": "Bearer no"}).status_code == 401
    assert sidecar.sidecar.gate.paused


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/agl/v1/pause", {"mode": "x" * 1_000_000}),
        ("/rollouts/r/end", {"mode": "x" * 1_000_000}),
        ("/rollouts/r/end", {"status": "x" * 1_000_000}),
    ],
)
def test_a_bad_value_is_not_echoed_at_length(fake, make_sidecar, path, body):
    # Before: a 1 MB bad `mode` came back in a 1 MB error.
    sidecar = make_sidecar(upstream=[fake.base_url])
    answer = httpx.post(sidecar.url + path, json=body, timeout=30)
    assert answer.status_code == 400 and len(answer.content) < 2000, answer.content[:300]
    assert "..." in answer.text
    httpx.post(sidecar.url + "/agl/v1/resume", json={})
