"""`--upstream http://user:PASS@host`: the engine gets the credentials as Basic auth; they never appear
in spans, /agl/v1/state, /metrics, error bodies or logs; a harness call that carries its own
Authorization header still works (aiohttp refuses a URL with credentials plus that header: it was a
500 on every such call)."""

from __future__ import annotations

import base64
import json
import logging

import httpx
import pytest

from agl import semconv
from agl_sidecar.config import ConfigError, build
from agl_testing.fake_vllm import FakeVLLM, Reply, Request, capture

SECRET = "S3cr3t@pw"  # '@' is percent-encoded in the URL
BASIC = "Basic " + base64.b64encode(f"agl:{SECRET}".encode()).decode()
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 12}


def _engine_behind_basic_auth(request: Request) -> Reply:
    if request.headers.get("authorization") != BASIC:
        return Reply(status=401, body=b'{"error":{"message":"unauthorized"}}')
    return Reply(body=capture("chat_nonstream_token_ids_logprobs.json"))


def test_url_credentials_go_to_the_engine_as_basic_auth_and_nowhere_else(make_sidecar, otlp_sink, caplog):
    with FakeVLLM(script=_engine_behind_basic_auth) as engine:
        host = engine.base_url.removeprefix("http://")
        sidecar = make_sidecar(
            upstream=[f"http://agl:S3cr3t%40pw@{host}/v1"], otlp_endpoint=otlp_sink.endpoint, log_level="debug"
        )
        with caplog.at_level(logging.DEBUG):
            plain = httpx.post(sidecar.url + "/rollouts/r/v1/chat/completions", json=CHAT)
            with_key = httpx.post(
                sidecar.url + "/rollouts/r/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer harness"}
            )
            assert plain.status_code == 200, plain.text
            assert with_key.status_code == 200, with_key.text
            assert [r.headers["authorization"] for r in engine.scripted_requests] == [BASIC, BASIC]
            spans = otlp_sink.wait_for(lambda spans: len(spans) >= 2)
            state = httpx.get(sidecar.url + "/agl/v1/state").text
            metrics = httpx.get(sidecar.url + "/metrics").text
        for span in spans:
            assert span.attributes[semconv.CALL_UPSTREAM] == engine.base_url
            assert "S3cr3t" not in json.dumps(span.attributes, default=str)
        assert engine.base_url in state
        for text in (state, metrics, caplog.text):
            assert "S3cr3t" not in text


def test_unreachable_upstream_with_credentials_names_the_host_only(make_sidecar, caplog):
    sidecar = make_sidecar(upstream=["http://agl:S3cr3tpw@127.0.0.1:9"])
    with caplog.at_level(logging.DEBUG):
        response = httpx.post(sidecar.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 502
    assert "127.0.0.1:9" in response.text and "S3cr3t" not in response.text
    assert "S3cr3t" not in caplog.text


@pytest.mark.parametrize("url", ["http://agl:S3cr3tpw@host:99999", "http://agl:S3cr3tpw@:8000", "ftp://agl:S3cr3tpw@h"])
def test_a_bad_upstream_url_is_a_config_error_that_does_not_echo_the_password(url):
    with pytest.raises(ConfigError) as error:
        build({"upstream": [url]})
    assert "S3cr3t" not in str(error.value) and "upstream" in str(error.value)


def test_resume_with_new_credentials_uses_them(make_sidecar):
    with FakeVLLM(script=_engine_behind_basic_auth) as engine:
        host = engine.base_url.removeprefix("http://")
        sidecar = make_sidecar(upstream=[f"http://agl:wrong@{host}"])
        assert httpx.post(sidecar.url + "/v1/chat/completions", json=CHAT).status_code == 401
        response = httpx.post(sidecar.url + "/agl/v1/resume", json={"upstreams": [f"http://agl:S3cr3t%40pw@{host}"]})
        assert response.status_code == 200 and "S3cr3t" not in response.text
        assert httpx.post(sidecar.url + "/v1/chat/completions", json=CHAT).status_code == 200
